"""Pixels by handle, the frontend's side: a prompt holds its images' segments until it is sent;
each engine request pins them for itself (n > 1: one pin each), and the pins go back when the
engine reports them, when the send fails, or not at all before then. Without handles the pixels
are copied into the request, as before."""

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


def test_each_engine_request_pins_its_images_until_the_engine_reports_them(frontend):
    pool, media = frontend.pool, frontend.inputs.media
    prompt = frontend.inputs.chat(messages(1, 2))
    first, second = (media.engine_request(prompt, f"r{i}", PARAMS, 0.0) for i in range(2))
    prompt.release_shared()
    assert all(f.pixel_values is None and f.pixel_handle.use_id > 0 for f in first.mm_features)
    assert len(set(handle_ids(first) + handle_ids(second))) == 4 == pool.stats().pinned
    assert media.mirror.images_by_handle == 4 and media.mirror.images_with_pixels == 0
    media.release_handles(handle_ids(first))
    assert pool.stats().pinned == 2 and pool.segments_in_use() == []  # still cached, and pinned
    media.release_handles(handle_ids(second))
    assert pool.stats().pinned == 0


def test_a_prompt_that_let_its_images_go_sends_them_by_hash(frontend):
    prompt = frontend.inputs.chat(messages(3))
    prompt.release_shared()
    [feature] = frontend.inputs.media.engine_request(prompt, "r", PARAMS, 0.0).mm_features
    assert feature.by_hash and feature.pixel_handle is None and feature.pixel_values is None
    assert frontend.pool.stats().pinned == 0


def test_without_handles_the_pixels_are_copied_into_the_request(frontend):
    media = frontend.inputs.media
    media.by_handle = False
    prompt = frontend.inputs.chat(messages(4))
    [feature] = media.engine_request(prompt, "r", PARAMS, 0.0).mm_features
    image = prompt.shared[feature.mm_hash]
    assert feature.pixel_handle is None and not np.shares_memory(feature.pixel_values, image.pixel_values)
    np.testing.assert_array_equal(feature.pixel_values, image.pixel_values)
    assert media.mirror.images_with_pixels == 1 and frontend.pool.stats().pinned == 0
    prompt.release_shared()


class RefusingClient:
    """An engine client whose sends fail (a closed socket, a cancelled task)."""

    async def add_request(self, request) -> None:
        raise ConnectionError("the engine's socket is closed")

    async def abort_requests(self, request_ids) -> None:
        pass


def test_a_request_that_cannot_be_sent_gives_back_its_pins(config, frontend):
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
    finally:
        real_client.shutdown()
