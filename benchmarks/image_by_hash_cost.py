"""What an image the engine already holds costs the frontend: CPU time of building a chat prompt
with it and its engine request (sent by hash: the mirror of the engine's pixel store lists it),
minus that of the same without the image and of decoding the data URL's base64 and hashing the
bytes, which any request with that image pays. Also the same with the image's pixels (the
mirror has forgotten it, untimed, before each call: a pool cache hit), for scale: copied into
the request, and by shared-memory handle (benchmarks/image_by_handle_cost.py measures a new
image end to end).

    .venv/bin/python -m benchmarks.image_by_hash_cost --size 1024 768 --repeats 200
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import time

from mmserve.entrypoints.llm import LLM
from mmserve.frontend.media_processor import handle_ids
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import synthetic_image
from preprocess import mm_hash


def cpu_ms(call, repeats: int, setup=None) -> float:
    """Median process CPU time of one call (`setup` before each, not counted), in ms."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.process_time()
        call()
        samples.append(1000 * (time.process_time() - start))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--size", type=int, nargs=2, default=(1024, 768))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    buffer = io.BytesIO()
    synthetic_image(*args.size, seed=1).save(buffer, format="JPEG", quality=90)
    data = buffer.getvalue()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}],
        }
    ]
    with LLM(checkpoint("qwen2_vl", args.preset), max_num_batched_tokens=8192, num_kv_blocks=2048) as llm:
        inputs = llm._inputs
        settings = llm._frontend.pool.settings

        def request(messages: list[dict]) -> None:
            """The prompt and its engine request, as the server makes them (the pins a request
            by handle takes are given back as EngineCore's report would)."""
            prompt = inputs.chat(messages)
            engine_request = inputs.media.engine_request(prompt, "r", SamplingParams(), 0.0)
            prompt.release()
            inputs.media.release_handles(handle_ids(engine_request))

        hashing = cpu_ms(lambda: mm_hash(base64.b64decode(url.split(",", 1)[1]), settings), args.repeats)
        llm.chat(messages, SamplingParams(max_tokens=1))  # the engine now holds the image
        probe = inputs.chat(messages)
        assert not probe.shared, "sent by hash"
        probe.release()
        by_hash = cpu_ms(lambda: request(messages), args.repeats)
        text_only = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
        no_image = cpu_ms(lambda: request(text_only), args.repeats)
        forget = inputs.media.mirror.reset  # as if the mirror had evicted it: the pool's cache hit
        by_handle = cpu_ms(lambda: request(messages), args.repeats, setup=forget)
        inputs.media.by_handle = False
        with_pixels = cpu_ms(lambda: request(messages), args.repeats, setup=forget)
    result = {
        "image": f"{args.size[0]}x{args.size[1]} JPEG, {len(data)} bytes",
        "base64_decode_and_hash_ms": round(hashing, 3),
        "prompt_without_the_image_ms": round(no_image, 3),
        "prompt_by_hash_ms": round(by_hash, 3),
        "image_beyond_hashing_ms": round(by_hash - no_image - hashing, 3),
        "prompt_by_handle_ms": round(by_handle, 3),
        "prompt_with_pixels_copied_ms": round(with_pixels, 3),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
