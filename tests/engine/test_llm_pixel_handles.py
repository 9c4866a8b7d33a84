"""Images go to EngineCore by shared-memory handle: greedy answers are token for token those of
the same image with its pixels copied into the request, the frontend copies no pixels for it
(the mirror's counters), and a segment recycled for another image or unlinked before EngineCore
reads it fails that request with a clear error at once — never a wait, never a wrong answer —
and the next request sends the image again. No pin or segment outlives a request.
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
    forget(llm, url)
    return answer


def forget(llm: LLM, url: str) -> None:
    """The engine's caches and the mirror drop the image (the next request brings it again)."""
    image_hash = hash_of(llm, url)
    llm.engine_core.scheduler.encoder_cache_manager.discard(image_hash)
    llm._inputs.media.mirror.drop([image_hash])


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


@pytest.mark.parametrize(("race", "seed"), [(recycle, 41), (unlink, 42)], ids=["recycled", "unlinked"])
def test_a_segment_lost_before_the_engine_reads_it_fails_the_request_not_a_wrong_answer(
    llm, race, seed, monkeypatch
):
    url = data_url(synthetic_image(176, 132, seed=seed))
    expected = with_copied_pixels(llm, url)
    send = llm._client.add_request
    lost = []

    def send_after_the_race(request: EngineRequest) -> None:
        [handle] = request.mm_handles.values()
        assert handle.use_id > 0, "sent by a pinned handle"
        lost.append((handle, race(handle)))
        send(request)  # EngineCore reads the handle here, in this process
        restore(*lost.pop())

    monkeypatch.setattr(llm._client, "add_request", send_after_the_race)
    runs = llm.stats().encoder_runs
    [output] = llm.chat(chat(url), GREEDY)
    monkeypatch.undo()
    assert output.finished and output.error is not None and "could not be read" in output.error
    assert llm.stats().encoder_runs == runs, "nothing encoded from the lost segment"
    mirror = llm._inputs.media.mirror
    assert hash_of(llm, url) not in mirror, "the mirror heard of it"
    assert tokens(llm, url) == expected, "the next request sends it again"
    assert mirror.engine_keys() == llm.engine_core.pixel_store.keys()
    assert_nothing_left(llm)
