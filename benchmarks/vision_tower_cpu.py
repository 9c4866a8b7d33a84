"""A bf16 model's vision tower on the CPU, float32 tower (`MMSERVE_CPU_WIDEN_BF16=auto`, where the
CPU has AVX512-BF16 and no AMX) against bf16 tower (`never`), in separate processes alternated.

    .venv/bin/python -m benchmarks.vision_tower_cpu MODEL_DIR --dataset-path DIR [--images 12] [--pairs 2]

Each process loads the model in bf16 with the CPU kernels, preprocesses the first `--images`
images of the VisionArena-format set with transformers' processor, warms up on two, then times
`encode_images` over all of them one at a time (wall seconds, every torch thread).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path


def time_tower(model_dir: str, dataset_path: str, images: int) -> float:
    import pyarrow.parquet as pq
    import torch
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from mmserve.config import ExecutionConfig
    from mmserve.models.registry import load_model_config
    from mmserve.worker.kernel_plan import load_planned_model

    table = pq.read_table(sorted(Path(dataset_path).glob("data/*.parquet"))[0], columns=["images"])
    blobs = [row[0]["bytes"] for row in table.column("images").to_pylist()[:images]]
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]
    inputs = [processor(images=[picture], return_tensors="pt") for picture in pictures]
    config = load_model_config(model_dir, dtype="bfloat16")
    model, _, _ = load_planned_model(
        config, torch.device("cpu"), ExecutionConfig(attention_backend="cpu"), 16
    )

    def encode(x) -> None:
        model.encode_images([x["pixel_values"]], [tuple(g) for g in x["image_grid_thw"].tolist()])

    with torch.inference_mode():
        for x in inputs[:2]:
            encode(x)
        t0 = time.perf_counter()
        for x in inputs:
            encode(x)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--images", type=int, default=12)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(f"{time_tower(args.model_dir, args.dataset_path, args.images):.3f}")
        return
    command = [sys.executable, "-m", "benchmarks.vision_tower_cpu", args.model_dir, "--child"]
    command += ["--dataset-path", args.dataset_path, "--images", str(args.images)]
    for pair in range(args.pairs):
        for setting in ("never", "auto"):
            env = {**os.environ, "MMSERVE_CPU_WIDEN_BF16": setting}
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            seconds = float(out.split()[-1])
            print(f"pair {pair + 1}: MMSERVE_CPU_WIDEN_BF16={setting}: {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
