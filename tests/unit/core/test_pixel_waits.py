"""Images sent by hash: the engine uses the embeddings it holds; one it no longer holds makes the
request wait for its pixels (asked once, in `pixels_needed`), never run without them; pixels are
dropped once encoded; every encoder-cache change is reported for the frontend's mirror."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mmserve import protocol
from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.engine_core import EngineCore
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.protocol import EngineRequest, MultiModalFeature
from mmserve.sampling_params import SamplingParams

GRID = (1, 4, 4)  # 16 patches, 4 tokens after the 2x2 merge


class EncodingExecutor:
    """Samples token 7 for a request that computed all its tokens; checks that every image it is
    asked to encode has pixels (as the real runner does) and records the encoded hashes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.encoded: list[str] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for index in indices:
                feature = self.scheduler.requests[request_id].mm_features[index]
                assert feature.pixel_values is not None, "scheduled for encoding without pixels"
                self.encoded.append(feature.mm_hash)
        ids = list(scheduler_output.num_scheduled_tokens)
        tokens = []
        for request_id in ids:
            request = self.scheduler.requests[request_id]
            tokens.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(ids, tokens)


def make_engine(encoder_cache_size: int = 8) -> EngineCore:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_blocks=128,
        encoder_budget=64,
        encoder_cache_size=encoder_cache_size,
    )
    return EngineCore(scheduler, EncodingExecutor(scheduler))


def pixels() -> np.ndarray:
    return np.ones((16, 12), dtype=np.float32)  # [patches, C·T·P·P]


def image(mm_hash: str, with_pixels: bool) -> MultiModalFeature:
    if with_pixels:
        return MultiModalFeature(mm_hash, 2, 4, GRID, pixels())
    return MultiModalFeature(mm_hash, 2, 4, GRID, by_hash=True)


def request(request_id: str, feature: MultiModalFeature) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, 11)),
        mm_features=[feature],
        sampling_params=SamplingParams(temperature=0, max_tokens=2),
        arrival_time=time.monotonic(),
    )


def run(engine: EngineCore, max_steps: int = 50) -> list[protocol.EngineCoreOutputs]:
    steps = []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        steps.append(engine.step())
    return steps


def test_an_image_the_engine_holds_is_used_by_hash_without_pixels():
    engine = make_engine()
    engine.add_request(request("first", image("a", with_pixels=True)))
    first = run(engine)
    assert first[0].encoder_cache_changes == {"a": True}
    engine.add_request(request("again", image("a", with_pixels=False)))
    steps = run(engine)
    assert all(not s.pixels_needed for s in steps)
    assert engine.executor.encoded == ["a"]  # encoded once, for the first request
    assert steps[-1].outputs[-1].finish_reason == "length"


def test_an_evicted_image_sent_by_hash_waits_for_its_pixels_then_runs():
    engine = make_engine(encoder_cache_size=4)  # room for one image
    engine.add_request(request("first", image("a", with_pixels=True)))
    run(engine)
    engine.add_request(request("evictor", image("b", with_pixels=True)))
    steps = run(engine)
    assert steps[0].encoder_cache_changes == {"a": False, "b": True}  # the mirror hears of both
    engine.add_request(request("late", image("a", with_pixels=False)))  # the mirror was behind
    waiting = [engine.step() for _ in range(3)]
    assert waiting[0].pixels_needed == [("late", "a")]
    assert all(not s.pixels_needed for s in waiting[1:]), "asked once"
    late = engine.scheduler.requests["late"]
    assert late.num_computed_tokens == 2  # computed up to the image, not into it
    engine.supply_pixels("late", "a", pixels())
    steps = run(engine)
    assert steps[-1].outputs[-1].request_id == "late"
    assert steps[-1].outputs[-1].finish_reason == "length"
    assert engine.executor.encoded == ["a", "b", "a"]


def test_pixels_are_dropped_once_encoded():
    engine = make_engine(encoder_cache_size=4)
    engine.add_request(request("first", image("a", with_pixels=True)))
    engine.step()
    feature = engine.scheduler.requests["first"].mm_features[0]
    assert feature.pixel_values is None and feature.by_hash


def test_pixels_for_a_finished_request_are_dropped_and_wrong_pixels_fail_it():
    engine = make_engine()
    engine.supply_pixels("gone", "a", pixels())  # nothing to do
    engine.add_request(request("late", image("a", with_pixels=False)))
    assert engine.step().pixels_needed == [("late", "a")]
    engine.supply_pixels("late", "a", np.ones((3, 12), dtype=np.float32))
    [output] = engine.step().outputs
    assert output.finish_reason == "error" and "do not match" in output.error
    assert engine.scheduler.encoder_cache_manager.num_references() == 0


def test_an_abort_while_waiting_for_pixels_frees_everything():
    engine = make_engine()
    engine.add_request(request("late", image("a", with_pixels=False)))
    engine.step()
    engine.abort_requests(["late"])
    run(engine)
    scheduler = engine.scheduler
    assert not scheduler.requests and scheduler.kv.num_used_blocks == 0
    assert scheduler.encoder_cache_manager.num_references() == 0
    assert scheduler.pixel_waits.num_waiting() == 0


@pytest.mark.parametrize("with_pixels", [(True, False), (False, True), (False, False), (True, True)])
def test_add_messages_carry_pixels_only_for_the_features_that_have_them(with_pixels):
    features = [
        MultiModalFeature(f"h{i}", 2 + 4 * i, 4, GRID, pixels() * i if has else None, by_hash=not has)
        for i, has in enumerate(with_pixels)
    ]
    engine_request = EngineRequest(
        request_id="r",
        prompt_token_ids=list(range(20)),
        mm_features=features,
        sampling_params=SamplingParams(),
        arrival_time=0.0,
    )
    frames = protocol.encode_add(engine_request)
    assert len(frames) == 2 + sum(with_pixels)
    decoded = protocol.decode_add([bytes(memoryview(f)) for f in frames])
    for sent, received in zip(features, decoded.mm_features):
        assert received.by_hash == sent.by_hash
        if sent.pixel_values is None:
            assert received.pixel_values is None
        else:
            np.testing.assert_array_equal(received.pixel_values, sent.pixel_values)


def test_a_pixels_message_round_trips():
    frames = protocol.encode_pixels("r", "h", pixels() * 3)
    request_id, mm_hash, array = protocol.decode_pixels([bytes(memoryview(f)) for f in frames])
    assert (request_id, mm_hash) == ("r", "h")
    np.testing.assert_array_equal(array, pixels() * 3)


def test_outputs_with_image_news_round_trip():
    outputs = protocol.EngineCoreOutputs(
        pixels_needed=[("r", "h")], encoder_cache_changes={"h": False, "g": True}
    )
    decoded = protocol.decode_outputs(protocol.encode_outputs(outputs))
    assert decoded.pixels_needed == [("r", "h")]
    assert list(decoded.encoder_cache_changes.items()) == [("h", False), ("g", True)]
