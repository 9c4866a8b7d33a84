"""Pixels by shared-memory handle, EngineCore's side: a handle is read into a copy of the engine's
own on receipt and reported released in the next outputs, whatever becomes of its request; a
segment that is gone, too short or holds other pixels is never encoded from — the request waits
for its pixels, and an answer by handle that cannot be read either is asked for again."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from msgspec.structs import replace
from test_pixel_waits import GRID, make_engine, request, run

from mmserve import protocol
from mmserve.core import pixel_handles
from mmserve.core.pixel_handles import read_pixels
from mmserve.protocol import EngineRequest, MultiModalFeature, PixelHandle
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


def by_handle(handle: PixelHandle) -> MultiModalFeature:
    return MultiModalFeature("a", 2, 4, GRID, pixel_handle=handle)


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


def test_a_request_by_handle_is_encoded_from_its_pixels_and_the_handle_released(make_segment: MakeSegment):
    engine = make_engine()
    engine.add_request(request("r", by_handle(make_segment(pixels(), use_id=7))))
    feature = engine.scheduler.requests["r"].mm_features[0]
    assert feature.pixel_handle is None and not feature.by_hash
    np.testing.assert_array_equal(feature.pixel_values, pixels())
    steps = run(engine)
    assert steps[0].released_pixel_handles == [7]
    assert all(not s.released_pixel_handles and not s.pixels_needed for s in steps[1:])
    assert engine.executor.encoded == ["a"]
    assert steps[-1].outputs[-1].finish_reason == "length"


def test_an_unreadable_handle_makes_its_request_wait_then_asks_again(make_segment: MakeSegment):
    engine = make_engine()
    recycled = make_segment(pixels(), use_id=1)
    overwrite(recycled, pixels(5.0))
    engine.add_request(request("r", by_handle(recycled)))
    first = engine.step()
    assert first.released_pixel_handles == [1] and first.pixels_needed == [("r", "a")]
    assert engine.executor.encoded == [] and engine.scheduler.requests["r"].num_computed_tokens == 2
    gone = make_segment(pixels(), use_id=2)
    shm.unlink(gone.shm_name)
    engine.supply_pixels("r", "a", gone)  # the answer's segment is gone too
    second = engine.step()
    assert second.released_pixel_handles == [2] and second.pixels_needed == [("r", "a")]
    engine.supply_pixels("r", "a", make_segment(pixels(), use_id=3))
    steps = run(engine)
    assert steps[0].released_pixel_handles == [3]
    assert engine.executor.encoded == ["a"]
    assert steps[-1].outputs[-1].finish_reason == "length"


def test_an_image_twice_in_a_request_is_read_once(make_segment: MakeSegment, monkeypatch):
    reads = []
    monkeypatch.setattr(pixel_handles, "read_pixels", lambda handle: reads.append(handle) or pixels())
    handle = make_segment(pixels(), use_id=1)
    features = [by_handle(handle), MultiModalFeature("a", 6, 4, GRID, pixel_handle=replace(handle, use_id=2))]
    assert pixel_handles.resolve_handles(features) == [1, 2]
    assert len(reads) == 1 and all(f.pixel_values is not None and f.pixel_handle is None for f in features)


def test_a_handle_for_a_finished_request_is_released_unread(make_segment: MakeSegment):
    engine = make_engine()
    handle = make_segment(pixels(), use_id=4)
    shm.unlink(handle.shm_name)  # not even looked at
    engine.supply_pixels("gone", "a", handle)
    assert engine.has_work(), "the release must be reported"
    assert engine.step().released_pixel_handles == [4]
    assert not engine.has_work()


def test_an_aborted_request_still_reports_its_handles(make_segment: MakeSegment):
    engine = make_engine()
    engine.add_request(request("r", by_handle(make_segment(pixels(), use_id=5))))
    engine.abort_requests(["r"])
    [step] = run(engine)
    assert step.released_pixel_handles == [5] and step.outputs[0].finish_reason == "abort"


def test_messages_carry_handles_without_frames():
    handle = PixelHandle("mmserve_pp_x", (16, 12), "float32", 2**64 - 1, 9)
    engine_request = EngineRequest(
        request_id="r",
        prompt_token_ids=list(range(10)),
        mm_features=[by_handle(handle)],
        sampling_params=SamplingParams(),
        arrival_time=0.0,
    )
    frames = protocol.encode_add(engine_request)
    assert len(frames) == 2
    [feature] = protocol.decode_add([bytes(memoryview(f)) for f in frames]).mm_features
    assert feature.pixel_handle == handle and feature.pixel_values is None
    frames = protocol.encode_pixels("r", "a", handle)
    assert len(frames) == 2
    assert protocol.decode_pixels([bytes(memoryview(f)) for f in frames]) == ("r", "a", handle)
    outputs = protocol.EngineCoreOutputs(released_pixel_handles=[9, 3])
    assert protocol.decode_outputs(protocol.encode_outputs(outputs)).released_pixel_handles == [9, 3]
