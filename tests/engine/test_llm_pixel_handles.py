"""Images go to EngineCore by shared-memory handle: greedy answers are token for token those of
the same image with its pixels copied into the request, the frontend copies no pixels for it
(the mirror's counters), and a segment recycled for another image or unlinked before EngineCore
reads it costs a wait for the pixels, never a wrong answer. No pin or segment outlives a request.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from engine_cases import data_url

from mmserve.entrypoints.llm import LLM
from mmserve.protocol import EngineRequest
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import synthetic_image
from preprocess import mm_hash, shm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def chat(url: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(
        checkpoint("qwen2_vl"),
        dtype="float32",
        max_num_batched_tokens=64,
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    with engine:
        yield engine


def tokens(llm: LLM, url: str) -> list[int]:
    [output] = llm.chat(chat(url), GREEDY)
    return output.outputs[0].token_ids


def hash_of(llm: LLM, url: str) -> str:
    return mm_hash(base64.b64decode(url.split(",", 1)[1]), llm._frontend.pool.settings)


def with_copied_pixels(llm: LLM, url: str) -> list[int]:
    """The answer with the image's pixels copied into the request (no handles), after which the
    engine and the mirror forget the image: the next request must send it again."""
    media = llm._inputs.media
    media.by_handle = False
    try:
        answer = tokens(llm, url)
    finally:
        media.by_handle = True
    image_hash = hash_of(llm, url)
    llm.engine_core.scheduler.encoder_cache_manager.discard(image_hash)
    media.mirror.apply({image_hash: False})
    return answer


def assert_nothing_left(llm: LLM) -> None:
    pool = llm._frontend.pool
    assert pool.stats().pinned == 0
    assert pool.segments_in_use() == []
    assert llm.stats().encoder_cache_references == 0


def test_an_image_by_handle_answers_as_with_copied_pixels_and_copies_nothing(llm):
    url = data_url(synthetic_image(200, 150, seed=31))
    expected = with_copied_pixels(llm, url)
    mirror = llm._inputs.media.mirror
    copies, handles, runs = mirror.images_with_pixels, mirror.images_by_handle, llm.stats().encoder_runs
    assert tokens(llm, url) == expected
    assert mirror.images_by_handle == handles + 1
    assert mirror.images_with_pixels == copies, "no pixel copy in the frontend"
    assert llm.stats().encoder_runs == runs + 1, "encoded from the pixels the handle named"
    assert_nothing_left(llm)


def recycle(handle) -> np.ndarray:
    """Write other pixels into the handle's segment, as a worker reusing it for another image
    would; returns what was there."""
    view = shm.map_writable(shm.ShmHandle(handle.shm_name, handle.shape), handle.nbytes, create=False)
    before = np.array(view)
    view[...] = -view
    return before


def unlink(handle) -> np.ndarray:
    """Unlink the handle's segment; returns what it held."""
    before = np.array(shm.attach(shm.ShmHandle(handle.shm_name, handle.shape)))
    shm.unlink(handle.shm_name)
    return before


def restore(handle, pixels: np.ndarray) -> None:
    """Put the pool's segment back as it was (linked, its pixels), for the pool's later users."""
    create = handle.shm_name not in shm.list_segments(handle.shm_name)
    segment_bytes = shm.segment_size(handle.nbytes)
    view = shm.map_writable(shm.ShmHandle(handle.shm_name, handle.shape), segment_bytes, create=create)
    view[...] = pixels


@pytest.mark.parametrize(
    ("race", "restored_after_the_read", "seed"),
    [(recycle, True, 41), (unlink, True, 42), (unlink, False, 43)],
    ids=["recycled", "unlinked", "unlinked-until-answered"],
)
def test_a_segment_lost_before_the_engine_reads_it_costs_a_wait_not_a_wrong_answer(
    llm, race, restored_after_the_read, seed, monkeypatch
):
    """Until answered: the answer's handle names the lost segment too, so the engine asks again,
    and the second answer is the array."""
    url = data_url(synthetic_image(176, 132, seed=seed))
    expected = with_copied_pixels(llm, url)
    send = llm._client.add_request
    lost = []

    def send_after_the_race(request: EngineRequest) -> None:
        [feature] = request.mm_features
        handle = feature.pixel_handle
        assert handle is not None and handle.use_id > 0, "sent by a pinned handle"
        lost.append((handle, race(handle)))
        send(request)  # EngineCore reads the handle here, in this process
        if restored_after_the_read:
            restore(*lost.pop())

    monkeypatch.setattr(llm._client, "add_request", send_after_the_race)
    mirror = llm._inputs.media.mirror
    resent, copied, runs = mirror.pixels_resent, mirror.pixels_resent_copied, llm.stats().encoder_runs
    try:
        assert tokens(llm, url) == expected
    finally:
        for handle, pixels in lost:
            restore(handle, pixels)
    asks = 1 if restored_after_the_read else 2
    assert (mirror.pixels_resent, mirror.pixels_resent_copied) == (resent + asks, copied + asks - 1)
    assert llm.stats().encoder_runs == runs + 1
    assert_nothing_left(llm)
