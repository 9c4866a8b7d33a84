"""Random aborts of image requests leave nothing behind: no shared-memory segment outside the
preprocess cache, no pin of a pixel handle, no hold on the mirror of the engine's pixel store,
no request, KV block or encoder-cache reference in EngineCore. The encoder cache holds about one
image and the pixel store two or three, so requests sent by hash often find their embeddings
evicted (encoded again from the store) and the store evicts often; no request fails. Nor does
EngineCore's death leave anything: the pins of the handles it was sent are given back.

MMSERVE_ABORT_ROUNDS sets the number of aborted requests (default 300; the issue's figure:
MMSERVE_ABORT_ROUNDS=1000 .venv/bin/python -m pytest -q tests/e2e/test_image_aborts.py).
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import signal

import pytest

from mmserve.engine_args import EngineArgs
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.core_client import EngineDeadError
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import png_bytes, synthetic_image
from preprocess import probe

ROUNDS = int(os.environ.get("MMSERVE_ABORT_ROUNDS", "300"))
CONCURRENCY = 8


def messages(urls: list[str]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}]


async def one_request(
    engine: AsyncLLM, inputs, request_id: str, urls: list[str], rng: random.Random, errors: list[str]
) -> bool:
    """Submit, then leave after a random number of outputs or a random time; True if aborted.
    An error the engine reports goes to `errors`."""
    prompt = await inputs.chat_async(messages(urls))
    params = SamplingParams(temperature=0.0, max_tokens=rng.choice([4, 16]))
    stream = engine.generate(request_id, prompt, params)
    leave_after = rng.choice([0, 0, 1, 2, 3, None])

    async def consume() -> bool:
        seen = 0
        async for output in stream:
            seen += 1
            if output.error:
                errors.append(output.error)
            if output.finished:
                return False
            if leave_after is not None and seen > leave_after:
                return True
        return False

    try:
        aborted = await asyncio.wait_for(consume(), timeout=rng.choice([0.001, 0.01, 0.05, 5.0]))
    except asyncio.TimeoutError:
        aborted = True
    await stream.aclose()  # leaving the stream early aborts the request
    return aborted


STORE_GB = 0.0006  # ~640 kB: two or three of the pictures' pixels (the pool's cache too)


def engine_config(model_path, encoder_cache_size: int = 0):
    args = EngineArgs(
        model=model_path,
        preprocess_workers=1,
        max_num_batched_tokens=64,
        num_kv_blocks=128,
        encoder_cache_size=encoder_cache_size,
        mm_processor_cache_gb=STORE_GB,
    )
    return args.create_engine_config()


async def abort_many(model_path) -> tuple[dict, int]:
    pictures = [png_bytes(synthetic_image(56 + 28 * k, 56 + 14 * k, seed=k)) for k in range(6)]
    frontend = build_frontend(engine_config(model_path), MediaLoader(), open_ended=False)
    largest = max(probe(p, frontend.pool.settings).num_tokens for p in pictures)
    engine = AsyncLLM(engine_config(model_path, largest), frontend.outputs, inputs=frontend.inputs)
    await engine.start()
    try:
        rng = random.Random(0)
        urls = ["data:image/png;base64," + base64.b64encode(p).decode() for p in pictures]
        aborted = 0
        errors: list[str] = []
        for start in range(0, ROUNDS, CONCURRENCY):
            batch = [
                one_request(
                    engine, frontend.inputs, f"r{i}", rng.sample(urls, rng.choice([1, 2])), rng, errors
                )
                for i in range(start, min(start + CONCURRENCY, ROUNDS))
            ]
            aborted += sum(await asyncio.gather(*batch))
        # A last request run to the end: its final outputs carry the engine's state after all
        # the aborts (they reach the engine before it, on the same socket).
        prompt = await frontend.inputs.chat_async(messages(urls[:1]))
        async for _ in engine.generate("last", prompt, SamplingParams(temperature=0.0, max_tokens=2)):
            pass
        stats = engine.latest_stats
        mirror = frontend.inputs.media.mirror
        state = {
            "engine_requests": stats.num_running + stats.num_waiting,
            "kv_blocks_in_use": stats.kv_blocks_in_use,
            "encoder_cache_references": stats.encoder_cache_references,
            "frontend_requests": int(frontend.outputs.has_unfinished()),
            "pool_pending": frontend.pool.stats().pending,
            "pinned_pixel_handles": frontend.pool.stats().pinned,
            "segments_outside_the_cache": frontend.pool.segments_in_use(),
            "mirror_holds": mirror.num_held(),
            "errors": errors,
            "pixel_bytes_sent": engine.client.pixel_bytes_sent,  # images go by handle: none
            "images_by_hash": mirror.images_by_hash,
            "images_by_handle": mirror.images_by_handle,
            "images_sent_again": mirror.images_by_handle > len(pictures),  # evicted from the store
        }
        return state, aborted
    finally:
        await engine.shutdown()
        frontend.close()


def test_random_aborts_of_image_requests_leave_nothing_behind(model_path):
    state, aborted = asyncio.run(abort_many(model_path))
    print(f"{aborted} of {ROUNDS} aborted; {state}")
    assert aborted >= ROUNDS // 2, f"only {aborted} of {ROUNDS} requests were aborted"
    paths = ("images_by_hash", "images_by_handle", "images_sent_again")
    assert all(state[path] for path in paths), state  # every path was taken (sent again once evicted)
    leftovers = {k: v for k, v in state.items() if k not in paths and v}
    assert not leftovers, state


async def die_with_handles_in_flight(model_path) -> dict:
    """Stop EngineCore (SIGSTOP), send it requests by handle it cannot read, then kill it."""
    pictures = [png_bytes(synthetic_image(56 + 28 * k, 70, seed=50 + k)) for k in range(2)]
    frontend = build_frontend(engine_config(model_path), MediaLoader(), open_ended=False)
    engine = AsyncLLM(engine_config(model_path), frontend.outputs, inputs=frontend.inputs)
    await engine.start()
    try:
        urls = ["data:image/png;base64," + base64.b64encode(p).decode() for p in pictures]
        os.kill(engine.client.process.pid, signal.SIGSTOP)
        params = SamplingParams(temperature=0.0, max_tokens=4, n=2)
        prompt = await frontend.inputs.chat_async(messages(urls))
        stream = engine.generate("doomed", prompt, params)
        first = asyncio.ensure_future(anext(stream))

        async def all_sent() -> None:
            while frontend.pool.stats().pinned < 2:  # two images, by the first of n=2 requests
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_sent(), timeout=30)
        pinned = frontend.pool.stats().pinned
        os.kill(engine.client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await first
        await stream.aclose()
        return {
            "pinned_before_the_death": pinned,
            "pinned": frontend.pool.stats().pinned,
            "segments_outside_the_cache": frontend.pool.segments_in_use(),
        }
    finally:
        await engine.shutdown()
        frontend.close()


def test_engine_death_gives_back_the_pins_of_the_handles_it_was_sent(model_path):
    state = asyncio.run(die_with_handles_in_flight(model_path))
    assert state == {"pinned_before_the_death": 2, "pinned": 0, "segments_outside_the_cache": []}
