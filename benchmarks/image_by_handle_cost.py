"""What a new image costs the API server process, with its pixels copied into the request (as
before handles) and by shared-memory handle: process CPU time (all threads, ZeroMQ's I/O thread
included) from the chat messages to the request sent to a stand-in EngineCore in another
process, which reads the request as EngineCore does (into its pixel store: handles read) and
acknowledges it.
Each request brings an image the pool has not seen: decoding and preprocessing run in the
pool's worker process, not counted here; hashing the bytes is. The stand-in's CPU per request
is reported too (what receiving costs EngineCore). Its pixel store is full, as a running
server's soon is: each new image evicts the one before, whose memory the next reuses;
`--filling-store` keeps --mm-processor-cache-gb's 1 GiB instead, so the store only grows and
each image's memory is touched for the first time (page faults the receive CPU includes).

    .venv/bin/python -m benchmarks.image_by_handle_cost --size 1024 768 --requests 20
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing
import statistics
import tempfile
import time

import zmq

from mmserve import protocol
from mmserve.core.pixel_store import PixelStore
from mmserve.engine_args import EngineArgs
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.media_processor import handle_ids
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import synthetic_image

QWEN_MAX_PIXELS = 12845056  # Qwen2-VL's own bound: a 1024×768 photo is ~4,000 patches, 19 MB


def stand_in_engine(inbox: str, outbox: str, count: int) -> None:
    """Receive `count` requests as EngineCore does; acknowledge each with its handles' use ids,
    then report this process's CPU seconds per request."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(inbox)
    push.connect(outbox)
    samples = []
    store = PixelStore()
    for _ in range(count):
        start = time.process_time()  # CPU only: the wait for the request costs none
        frames = [frame.buffer for frame in pull.recv_multipart(copy=False)]
        request = protocol.decode_add(frames)
        released = store.apply(request).released_handles
        store.pixels_of(request.mm_features)
        samples.append(time.process_time() - start)
        push.send_json(released)
    push.send_json(statistics.median(samples))
    pull.close()
    push.close(linger=1000)
    ctx.term()


def new_images(count: int, size: tuple[int, int], seed: int) -> list[str]:
    urls = []
    for index in range(count):
        buffer = io.BytesIO()
        synthetic_image(*size, seed=seed + index).save(buffer, format="JPEG", quality=90)
        urls.append("data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode())
    return urls


def measure(frontend, urls: list[str], by_handle: bool, store_bytes: int) -> tuple[list[float], float, float]:
    """(API process CPU ms per request, the stand-in's median CPU ms, pixel MB sent per request);
    `store_bytes`: the stand-in's store capacity (0: each request evicts the image before)."""
    inputs, media = frontend.inputs, frontend.inputs.media
    media.by_handle = by_handle
    media.mirror.reset()  # a new stand-in: its store is empty
    media.mirror.capacity_bytes = store_bytes
    directory = tempfile.mkdtemp(prefix="mmserve-bench-")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{directory}/in")
    pull.bind(f"ipc://{directory}/out")
    peer = multiprocessing.get_context("spawn").Process(
        target=stand_in_engine, args=(f"ipc://{directory}/in", f"ipc://{directory}/out", len(urls))
    )
    peer.start()
    samples, pixel_bytes = [], 0
    params = SamplingParams(max_tokens=1)
    for index, url in enumerate(urls):
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        start = time.process_time()
        prompt = inputs.chat(messages)
        request = media.engine_request(prompt, f"r{index}", params, time.monotonic())
        prompt.release()
        frames = protocol.encode_add(request)
        pixel_bytes += sum(memoryview(frame).nbytes for frame in frames[2:])
        push.send_multipart(frames, copy=False)
        released = pull.recv_json()  # waits without CPU
        media.release_handles(released)
        samples.append(1000 * (time.process_time() - start))
        assert sorted(released) == sorted(handle_ids(request))
    engine_ms = 1000 * pull.recv_json()
    peer.join()
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    return samples, engine_ms, pixel_bytes / len(urls) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, nargs=2, default=(1024, 768))
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--filling-store", action="store_true", help="the stand-in's store only grows")
    args = parser.parse_args()
    config = EngineArgs(
        model=checkpoint("qwen2_vl"),
        preprocess_workers=1,
        mm_processor_kwargs={"max_pixels": QWEN_MAX_PIXELS},
    ).create_engine_config()
    frontend = build_frontend(config, MediaLoader(), open_ended=True)
    store_bytes = config.multimodal.processor_cache_bytes if args.filling_store else 0
    try:
        frontend.pool.wait_ready()
        measure(frontend, new_images(2, tuple(args.size), seed=10_000), True, store_bytes)  # warm up
        result = {"image": f"{args.size[0]}x{args.size[1]} JPEG, a new one per request"}
        for name, by_handle, seed in (("copied", False, 0), ("by_handle", True, 1000)):
            samples, engine_ms, pixel_mb = measure(
                frontend, new_images(args.requests, tuple(args.size), seed), by_handle, store_bytes
            )
            result[name] = {
                "api_cpu_ms_median": round(statistics.median(samples), 2),
                "api_cpu_ms_min": round(min(samples), 2),
                "engine_receive_cpu_ms_median": round(engine_ms, 2),
                "pixel_mb_sent_per_request": round(pixel_mb, 1),
            }
        assert frontend.pool.stats().pinned == 0
    finally:
        frontend.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
