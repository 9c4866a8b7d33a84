"""Pixels by shared-memory handle, EngineCore's side: a handle is read once, into the store's own
copy, on receipt, and reported released in the next outputs whatever becomes of its request; a
segment that is gone, too short or holds other pixels is never encoded from — the item is
stored as unreadable and reported, and every request needing it fails at once with a clear
error (none waits) until the frontend evicts it."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from test_pixel_store import GRID, image, make_engine, run

from mmserve import protocol
from mmserve.core import pixel_store
from mmserve.core.pixel_handles import read_pixels
from mmserve.protocol import EngineRequest, PixelHandle
from mmserve.sampling_params import SamplingParams
from preprocess import shm
from preprocess.hashing import pixels_digest

MakeSegment = Callable[..., PixelHandle]


def pixels(scale: float = 1.0) -> np.ndarray:
    return (np.arange(16 * 12, dtype=np.float32) * scale).reshape(16, 12)  # [patches, C·T·P·P]


@pytest.fixture
def make_segment() -> Iterator[MakeSegment]:
    """`make_segment(values, use_id)`: a segment holding `values` (as a preprocess worker
    writes one) and a handle to it; every segment is unlinked after the test."""
    names: list[str] = []

    def make(values: np.ndarray, use_id: int = 1) -> PixelHandle:
        name = f"{shm.SEGMENT_PREFIX}test_{secrets.token_hex(4)}"
        names.append(name)
        view = shm.map_writable(
            shm.ShmHandle(name, values.shape), shm.segment_size(values.nbytes), create=True
        )
        view[...] = values
        return PixelHandle(name, values.shape, "float32", pixels_digest(values), use_id)

    yield make
    for name in names:
        shm.unlink(name)


def overwrite(handle: PixelHandle, values: np.ndarray) -> None:
    """What a worker writing another image into a recycled segment does."""
    view = shm.map_writable(shm.ShmHandle(handle.shm_name, handle.shape), handle.nbytes, create=False)
    view[...] = values


def by_handle(request_id: str, handle: PixelHandle, mm_hash: str = "a", evict=()) -> EngineRequest:
    """A request for one image, its pixels by `handle` (GRID: 16 patches, 4 tokens)."""
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, 11)),
        mm_features=[image(mm_hash)],
        sampling_params=SamplingParams(temperature=0, max_tokens=2),
        arrival_time=0.0,
        mm_evict=list(evict),
        mm_handles={mm_hash: handle},
    )


def by_hash(request_id: str, mm_hash: str = "a") -> EngineRequest:
    request = by_handle(request_id, PixelHandle("x", (1,), "float32", 0, 0), mm_hash)
    request.mm_handles = {}
    return request


def test_a_handle_is_read_into_a_copy_of_the_engines_own(make_segment: MakeSegment):
    handle = make_segment(pixels())
    copy = read_pixels(handle)
    np.testing.assert_array_equal(copy, pixels())
    overwrite(handle, pixels(2.0))  # the pool may recycle the segment once the read is reported
    np.testing.assert_array_equal(copy, pixels())


def test_a_segment_gone_short_or_holding_other_pixels_reads_as_no_pixels(make_segment: MakeSegment):
    gone = make_segment(pixels())
    shm.unlink(gone.shm_name)
    recycled = make_segment(pixels())
    overwrite(recycled, pixels(3.0))
    short = make_segment(pixels())
    too_long = PixelHandle(short.shm_name, (16 * 1024, 12), "float32", short.digest, 1)
    assert read_pixels(gone) is None
    assert read_pixels(recycled) is None
    assert read_pixels(too_long) is None
    assert read_pixels(PixelHandle(short.shm_name, (16, 12), "no-such-dtype", short.digest, 1)) is None


def test_a_request_by_handle_is_encoded_from_its_pixels_and_the_handle_released(make_segment: MakeSegment):
    engine = make_engine()
    engine.add_request(by_handle("r", make_segment(pixels(), use_id=7)))
    np.testing.assert_array_equal(engine.scheduler.requests["r"].mm_pixels["a"], pixels())
    steps = run(engine)
    assert steps[0].released_pixel_handles == [7]
    assert all(not s.released_pixel_handles for s in steps[1:]) and not any(
        s.unreadable_pixels for s in steps
    )
    assert engine.executor.encoded == ["a"] and engine.executor.encoded_values == [0.0]
    assert steps[-1].outputs[-1].finish_reason == "length"
    engine.add_request(by_hash("again"))  # the store keeps the pixels
    assert run(engine)[-1].outputs[-1].finish_reason == "length"


def test_an_unreadable_handle_fails_its_requests_at_once_until_the_frontend_evicts_it(
    make_segment: MakeSegment,
):
    engine = make_engine()
    recycled = make_segment(pixels(), use_id=1)
    overwrite(recycled, pixels(5.0))
    engine.add_request(by_handle("r", recycled))
    engine.add_request(by_hash("before-the-report"))  # the frontend's mirror still lists it
    [step] = run(engine)
    assert step.released_pixel_handles == [1] and step.unreadable_pixels == ["a"]
    errors = {o.request_id: o.error for o in step.outputs}
    assert errors.keys() == {"r", "before-the-report"}
    assert all("could not be read" in error for error in errors.values())
    assert engine.executor.encoded == [], "never encoded from other pixels"
    assert "a" in engine.pixel_store, "kept (as unreadable) until the frontend evicts it"
    engine.add_request(by_handle("sent-again", make_segment(pixels(), use_id=2), evict=["a"]))
    steps = run(engine)
    assert steps[-1].outputs[-1].finish_reason == "length"
    assert engine.executor.encoded == ["a"]


def test_an_image_twice_in_a_request_is_read_once(make_segment: MakeSegment, monkeypatch):
    reads = []
    monkeypatch.setattr(pixel_store, "read_pixels", lambda handle: reads.append(handle) or pixels())
    engine = make_engine()
    request = by_handle("r", make_segment(pixels(), use_id=1))
    request.mm_features = [image("a"), image("a", offset=6)]
    engine.add_request(request)
    assert len(reads) == 1
    assert run(engine)[0].released_pixel_handles == [1]


def test_an_aborted_request_still_reports_its_handles(make_segment: MakeSegment):
    engine = make_engine()
    engine.add_request(by_handle("r", make_segment(pixels(), use_id=5)))
    engine.abort_requests(["r"])
    [step] = run(engine)
    assert step.released_pixel_handles == [5] and step.outputs[0].finish_reason == "abort"


def test_a_rejected_request_still_reports_its_handles_and_stores_its_pixels(make_segment: MakeSegment):
    engine = make_engine()
    request = by_handle("r", make_segment(pixels(), use_id=6))
    request.prompt_token_ids = list(range(1, 300))  # past max_model_len
    engine.add_request(request)
    [step] = run(engine)
    assert step.released_pixel_handles == [6] and step.outputs[0].finish_reason == "error"
    assert engine.pixel_store.keys() == {"a"}


def test_messages_carry_handles_without_frames():
    handle = PixelHandle("mmserve_pp_x", (16, 12), "float32", 2**64 - 1, 9)
    frames = protocol.encode_add(by_handle("r", handle))
    assert len(frames) == 2
    received = protocol.decode_add([bytes(memoryview(f)) for f in frames])
    assert received.mm_handles == {"a": handle} and received.mm_arrays == {}
    assert received.mm_features[0].grid_thw == GRID
