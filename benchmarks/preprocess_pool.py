"""Image preprocessing throughput: the preprocess pool against transformers' PIL processor.

Run from the repository root:

    .venv/bin/python -m benchmarks.preprocess_pool [--images 48] [--repeats 3] [--json PATH]

Checks first that the pool's output equals `Qwen2VLImageProcessorPil` on the same images, then
measures images/s on distinct JPEGs (transformers in this process; the pool inline and with
1 and 2 worker processes), and the latency of a cache hit against a miss. Prints a table and
writes the numbers as JSON.

Besides wall-clock rates it reports CPU time per image (this process plus the pool's workers):
on a machine shared with other jobs, wall time measures the neighbours as much as the code,
while CPU time per image says what a dedicated core would sustain.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file, this script's folder comes first on sys.path and `import preprocess` would
    # find this very file; the repository root is where the package lives.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np
import PIL
from PIL import Image, ImageOps

from preprocess import PreprocessPool
from preprocess.decode import decode_rgb
from preprocess.patchify import patchify_into
from preprocess.qwen_vl import QwenVLImageSettings, resize_rgb


def make_jpegs(count: int, width: int, height: int) -> list[bytes]:
    """Distinct photo-like JPEGs: smooth gradients plus seeded noise, quality 90."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 215
    images = []
    for seed in range(count):
        noise = np.random.default_rng(seed).integers(0, 40, (height, width, 3))
        buffer = io.BytesIO()
        Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def transformers_processor() -> Callable[[bytes], tuple[np.ndarray, np.ndarray]]:
    """bytes -> (pixel_values, image_grid_thw) the transformers way: open, EXIF-transpose, process.

    Imported here, not at the top: spawned pool workers re-import this module and must stay light.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil()

    def run(data: bytes) -> tuple[np.ndarray, np.ndarray]:
        out = processor(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), return_tensors="np")
        return out["pixel_values"], out["image_grid_thw"]

    return run


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) of this process and of the given child processes so far."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def best_of(repeats: int, run: Callable[[], None], pids: list[int]) -> tuple[float, float]:
    """Fastest wall time and smallest CPU time of `repeats` runs: the machine may be shared,
    and noise only ever adds time."""
    walls, cpus = [], []
    for _ in range(repeats):
        cpu, start = cpu_seconds(pids), time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
        cpus.append(cpu_seconds(pids) - cpu)
    return min(walls), min(cpus)


def check_same_output(pool: PreprocessPool, images: list[bytes], hf: Callable) -> float:
    """Assert equal grids and pixels within 1e-6 (the pool's frame against each of
    transformers' T copies); return the largest absolute difference."""
    worst = 0.0
    for data in images:
        expected_pixels, expected_grid = hf(data)
        with pool.process(data) as ours:
            assert ours.grid_thw == tuple(expected_grid[0]), (ours.grid_thw, expected_grid)
            # The pool writes the frame once; transformers repeats it over T (frame_dim).
            frames = expected_pixels.reshape(len(expected_pixels), 3, -1, ours.pixel_values.shape[1] // 3)
            assert (frames == frames[:, :, :1]).all()
            diff = float(np.abs(ours.pixel_values - frames[:, :, 0].reshape(len(frames), -1)).max())
        assert diff <= 1e-6, diff
        worst = max(worst, diff)
    return worst


def pool_throughput(
    settings: QwenVLImageSettings, workers: int, images: list[bytes], repeats: int
) -> tuple[float, float]:
    """(images/s, CPU seconds per image) for bursts of distinct images through `process_async`
    (cache off)."""
    with PreprocessPool(settings, num_workers=workers, cache_bytes=0) as pool:
        assert pool.wait_ready(120)

        async def burst() -> None:
            async def one(data: bytes) -> None:
                (await pool.process_async(data)).release()

            await asyncio.gather(*(one(data) for data in images))

        asyncio.run(burst())  # warm-up: first-use costs in every worker
        wall, cpu = best_of(repeats, lambda: asyncio.run(burst()), pool.worker_pids())
        return len(images) / wall, cpu / len(images)


def stage_costs(settings: QwenVLImageSettings, images: list[bytes]) -> dict[str, float]:
    """Median CPU seconds per image of each step of one worker task (where the time goes)."""
    arrays = [resize_rgb(decode_rgb(data, settings), settings) for data in images]
    sizes = [(array.shape[1], array.shape[0]) for array in arrays]  # (width, height), PIL order
    out = np.empty(settings.pixel_values_shape(settings.grid(*arrays[0].shape[:2])), np.float32)
    steps: dict[str, Callable[[int], object]] = {
        "decode + to RGB": lambda i: decode_rgb(images[i], settings),
        "bicubic resize": lambda i: resize_rgb(decode_rgb(images[i], settings), settings),
        # the former path: Pillow's resize on the decoded image, then its pixels as an array
        "... by Pillow instead": lambda i: np.asarray(
            decode_rgb(images[i], settings).resize(sizes[i], Image.Resampling.BICUBIC)
        ),
        "normalise + patchify": lambda i: patchify_into(arrays[i], settings, out),
    }
    costs = {}
    for name, step in steps.items():
        times = []
        for i in range(len(images)):
            start = time.thread_time()
            step(i)
            times.append(time.thread_time() - start)
        costs[name] = statistics.median(times)
    costs["bicubic resize"] -= costs["decode + to RGB"]
    costs["... by Pillow instead"] -= costs["decode + to RGB"]
    return costs


def hit_and_miss_latency(settings: QwenVLImageSettings, images: list[bytes]) -> tuple[float, float]:
    """Mean seconds per blocking `process` call: distinct images (misses), then one cached image."""
    with PreprocessPool(settings, num_workers=1, cache_bytes=64 << 20) as pool:
        assert pool.wait_ready(120)
        pool.process(images[0]).release()  # warm-up: first-use costs in the worker
        start = time.perf_counter()
        for data in images[1:]:
            pool.process(data).release()
        miss_s = (time.perf_counter() - start) / (len(images) - 1)
        pool.process(images[0]).release()  # cached now, whatever the misses evicted
        hits = 2000
        start = time.perf_counter()
        for _ in range(hits):
            pool.process(images[0]).release()
        hit_s = (time.perf_counter() - start) / hits
        assert pool.stats().tasks_submitted <= len(images) + 1
    return hit_s, miss_s


def machine() -> dict[str, object]:
    cpu = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pillow": PIL.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=48, help="distinct JPEGs per burst")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="pool sizes to measure")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per measurement (best is kept)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/preprocess.json"))
    args = parser.parse_args()

    settings = QwenVLImageSettings()  # transformers' defaults: max_pixels 28·28·1280
    facts = machine()
    images = make_jpegs(args.images, args.width, args.height)
    hf = transformers_processor()

    with PreprocessPool(settings, num_workers=0) as inline:
        max_abs_diff = check_same_output(inline, images[:8], hf)

    def run_transformers() -> None:
        for data in images:
            hf(data)

    hf(images[0])  # warm-up
    wall, cpu = best_of(args.repeats, run_transformers, [])
    results = {"transformers (1 process)": (len(images) / wall, cpu / len(images))}
    results["pool, inline (0 workers)"] = pool_throughput(settings, 0, images, args.repeats)
    for workers in args.workers:
        name = f"pool, {workers} worker{'s' * (workers > 1)}"
        results[name] = pool_throughput(settings, workers, images, args.repeats)
    hit_s, miss_s = hit_and_miss_latency(settings, images)
    stages = stage_costs(settings, images)
    facts["load_average_at_end"] = os.getloadavg()

    base_rate, base_cpu = results["transformers (1 process)"]
    print(f"{args.images} distinct {args.width}x{args.height} JPEGs, Qwen2-VL default settings; {facts}")
    print(f"outputs equal transformers (max |diff| = {max_abs_diff:g})\n")
    print(f"{'':26} {'images/s':>9} {'vs transformers':>16} {'CPU ms/image':>13} {'vs transformers':>16}")
    for name, (rate, cpu) in results.items():
        print(f"{name:26} {rate:9.1f} {rate / base_rate:15.2f}x {cpu * 1e3:13.1f} {base_cpu / cpu:15.2f}x")
    print("\nCPU ms per image of each step in a worker (median):")
    for name, cost in stages.items():
        print(f"  {name:22} {cost * 1e3:6.2f}")
    print(f"\ncache miss {miss_s * 1e3:.2f} ms, cache hit {hit_s * 1e6:.1f} us per image")
    print(f"hit / miss = {hit_s / miss_s:.3%}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "command": " ".join(
                    [f"python -m {__spec__.name}" if __spec__ else sys.argv[0], *sys.argv[1:]]
                ),
                "machine": facts,
                "images": args.images,
                "size": [args.width, args.height],
                "max_abs_diff_vs_transformers": max_abs_diff,
                "images_per_s": {k: rate for k, (rate, _) in results.items()},
                "speedup_vs_transformers": {k: rate / base_rate for k, (rate, _) in results.items()},
                "cpu_s_per_image": {k: cpu for k, (_, cpu) in results.items()},
                "worker_step_cpu_s": stages,
                "cache_hit_s": hit_s,
                "cache_miss_s": miss_s,
                "hit_over_miss": hit_s / miss_s,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
