"""Pixels by handle, the frontend's side: a prompt holds its images' segments until it is sent;
the engine request that brings an image to the engine's pixel store pins it (n > 1: the first
request only, the others go by hash), and the pins go back when the engine reports them, or
when the send fails — then the mirror forgets what the request would have added. Without handles
the pixels are copied into the request, as before."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from mmserve.engine_args import EngineArgs
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.media_processor import handle_ids
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import png_bytes, synthetic_image
from mmserve.testing.run_apart import run_apart
from preprocess import shm

PARAMS = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def config():
    return EngineArgs(checkpoint("qwen2_vl"), preprocess_workers=0).create_engine_config()


@pytest.fixture
def frontend(config):
    frontend = build_frontend(config, MediaLoader(), open_ended=False)
    yield frontend
    frontend.close()


def messages(*seeds: int) -> list[dict]:
    urls = [
        "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(84, 56, seed=s))).decode()
        for s in seeds
    ]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]


def test_an_image_is_pinned_by_the_request_that_brings_it_until_the_engine_reports_it(frontend):
    pool, media = frontend.pool, frontend.inputs.media
    prompt = frontend.inputs.chat(messages(1, 2))
    first, second = (media.engine_request(prompt, f"r{i}", PARAMS, 0.0) for i in range(2))
    prompt.release()
    assert first.mm_arrays == {} and all(h.use_id > 0 for h in first.mm_handles.values())
    assert first.mm_handles.keys() == {f.mm_hash for f in first.mm_features}
    assert second.mm_handles == {} and second.mm_arrays == {}, "n > 1: the others go by hash"
    assert len(handle_ids(first)) == 2 == pool.stats().pinned
    mirror = media.mirror
    assert (mirror.images_by_handle, mirror.images_by_hash, mirror.images_with_pixels) == (2, 2, 0)
    assert pool.segments_in_use() == []  # the prompt let them go; the pins hold their own
    media.release_handles(handle_ids(first))
    assert pool.stats().pinned == 0 and media.mirror.num_held() == 0


def test_an_image_the_engine_holds_is_sent_by_hash_without_asking_the_pool(frontend):
    media = frontend.inputs.media
    sent = frontend.inputs.chat(messages(3))
    request = media.engine_request(sent, "r", PARAMS, 0.0)
    sent.release()
    media.release_handles(handle_ids(request))
    queries = frontend.pool.stats().cache_queries
    prompt = frontend.inputs.chat(messages(3))
    assert frontend.pool.stats().cache_queries == queries, "not even a cache lookup"
    assert prompt.shared == {} and media.mirror.num_held() == 1
    [feature] = prompt.features
    again = media.engine_request(prompt, "r2", PARAMS, 0.0)
    assert again.mm_handles == {} and again.mm_arrays == {} and again.mm_features == [feature]
    prompt.release()
    assert frontend.pool.stats().pinned == 0


def test_without_handles_the_pixels_are_copied_into_the_request(frontend):
    media = frontend.inputs.media
    media.by_handle = False
    prompt = frontend.inputs.chat(messages(4))
    request = media.engine_request(prompt, "r", PARAMS, 0.0)
    [feature] = request.mm_features
    image = prompt.shared[feature.mm_hash]
    pixels = request.mm_arrays[feature.mm_hash]
    assert request.mm_handles == {} and not np.shares_memory(pixels, image.pixel_values)
    np.testing.assert_array_equal(pixels, image.pixel_values)
    assert media.mirror.images_with_pixels == 1 and frontend.pool.stats().pinned == 0
    prompt.release()


class RefusingClient:
    """An engine client whose sends fail (a closed socket, a cancelled task)."""

    async def add_request(self, request) -> None:
        raise ConnectionError("the engine's socket is closed")

    async def abort_requests(self, request_ids) -> None:
        pass


def test_a_request_that_cannot_be_sent_gives_back_its_pins_and_its_store_changes(config, frontend):
    engine = AsyncLLM(config, frontend.outputs, inputs=frontend.inputs)
    real_client, engine.client = engine.client, RefusingClient()
    try:
        prompt = frontend.inputs.chat(messages(5, 6))
        stream = engine.generate("r", prompt, SamplingParams(max_tokens=1, n=2))
        with pytest.raises(ConnectionError):
            run_apart(anext(stream))
        assert frontend.pool.stats().pinned == 0
        assert frontend.pool.segments_in_use() == []  # nor does the prompt hold them
        assert shm.list_segments(frontend.pool.segment_prefix)  # (the cache does)
        mirror = frontend.inputs.media.mirror
        assert mirror.engine_keys() == set() and mirror.num_held() == 0
    finally:
        real_client.shutdown()
