"""EngineCore's pixel store: every request drops what it names, then stores the pixels it brings,
whatever becomes of it; an item sent by hash is then always there, so a request whose item's
embeddings the encoder cache evicted encodes it again from the pixels it holds — it never waits
and never asks for them. Pixels reach the runner only with the step that encodes them."""

from __future__ import annotations

import logging
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
    asked to encode comes with its pixels in the step (as the real runner needs) and records the
    encoded hashes and their pixels' first value."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.encoded: list[str] = []
        self.encoded_values: list[float] = []
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        encoded = [
            self.scheduler.requests[request_id].mm_features[index].mm_hash
            for request_id, indices in scheduler_output.scheduled_encoder_inputs.items()
            for index in indices
        ]
        assert set(scheduler_output.encoder_pixels) == set(encoded), "pixels exactly for what is encoded"
        self.encoded += encoded
        self.encoded_values += [float(scheduler_output.encoder_pixels[h][0, 0]) for h in encoded]
        ids = list(scheduler_output.num_scheduled_tokens)
        tokens = []
        for request_id in ids:
            request = self.scheduler.requests[request_id]
            tokens.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(ids, tokens)

    def shutdown(self) -> None:
        pass


def make_engine(
    encoder_cache_size: int = 8, num_blocks: int = 128, scheduling_policy: str = "fcfs"
) -> EngineCore:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, scheduling_policy=scheduling_policy
        ),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_blocks=num_blocks,
        encoder_budget=64,
        encoder_cache_size=encoder_cache_size,
    )
    return EngineCore(scheduler, EncodingExecutor(scheduler))


def pixels(value: float = 1.0) -> np.ndarray:
    return np.full((16, 12), value, dtype=np.float32)  # [patches, C·T·P·P]


def image(mm_hash: str, offset: int = 2) -> MultiModalFeature:
    return MultiModalFeature(mm_hash, offset, 4, GRID)


def request(
    request_id: str,
    *features: MultiModalFeature,
    arrays: dict[str, np.ndarray] | None = None,
    evict: list[str] | None = None,
    max_tokens: int = 2,
) -> EngineRequest:
    """A 10-token prompt (20 with two items) bringing `arrays`; its other items go by hash."""
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, 11 if len(features) < 2 else 21)),
        mm_features=list(features),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        arrival_time=time.monotonic(),
        mm_evict=evict or [],
        mm_arrays=arrays or {},
    )


def run(engine: EngineCore, max_steps: int = 50) -> list[protocol.EngineCoreOutputs]:
    steps = []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        steps.append(engine.step())
    return steps


def finish_reasons(steps: list[protocol.EngineCoreOutputs]) -> dict[str, str]:
    return {o.request_id: o.finish_reason for s in steps for o in s.outputs if o.finish_reason}


def test_an_image_sent_by_hash_uses_the_cached_embeddings_without_pixels():
    engine = make_engine()
    engine.add_request(request("first", image("a"), arrays={"a": pixels()}))
    run(engine)
    engine.add_request(request("again", image("a")))
    assert finish_reasons(run(engine)) == {"again": "length"}
    assert engine.executor.encoded == ["a"]  # encoded once, for the first request


def test_an_image_whose_embeddings_were_evicted_is_encoded_again_from_the_store_without_a_wait():
    engine = make_engine(encoder_cache_size=4)  # room for one image's embeddings
    engine.add_request(request("first", image("a"), arrays={"a": pixels(1.0)}))
    engine.add_request(request("evictor", image("b"), arrays={"b": pixels(2.0)}))
    run(engine)
    engine.add_request(request("late", image("a")))  # by hash: the store holds its pixels
    steps = run(engine)
    assert finish_reasons(steps) == {"late": "length"}
    assert len(steps) == 2, "prompt then decode: no step waits"
    assert engine.executor.encoded == ["a", "b", "a"]
    assert engine.executor.encoded_values == [1.0, 2.0, 1.0]


def test_a_request_keeps_its_pixels_after_both_caches_drop_them_and_it_recomputes():
    # One request's KV blocks at a time, one image's embeddings; "urgent" preempts "first".
    engine = make_engine(encoder_cache_size=4, num_blocks=6, scheduling_policy="priority")
    engine.add_request(request("first", image("a"), arrays={"a": pixels(3.0)}, max_tokens=8))
    run(engine, max_steps=2)  # past its image, decoding
    urgent = request("urgent", image("b"), arrays={"b": pixels(4.0)}, evict=["a"], max_tokens=8)
    urgent.priority = -1
    engine.add_request(urgent)  # the frontend dropped "a" from the store
    assert engine.pixel_store.keys() == {"b"}
    steps = run(engine, max_steps=100)
    assert finish_reasons(steps) == {"first": "length", "urgent": "length"}
    assert engine.scheduler.num_preemptions == 1
    assert engine.executor.encoded == ["a", "b", "a"], "recomputing, encoded again from its own pixels"
    assert engine.executor.encoded_values == [3.0, 4.0, 3.0]


def test_evictions_apply_before_the_pixels_a_request_brings():
    engine = make_engine()
    engine.add_request(request("first", image("a"), arrays={"a": pixels(1.0)}))
    engine.add_request(request("again", image("a"), arrays={"a": pixels(6.0)}, evict=["a"]))
    assert engine.pixel_store.keys() == {"a"}
    assert float(engine.pixel_store.pixels_of([image("a")])["a"][0, 0]) == 6.0


def test_a_rejected_request_still_changes_the_store():
    engine = make_engine()
    engine.add_request(request("first", image("a"), arrays={"a": pixels()}))
    too_long = request("too-long", image("b"), arrays={"b": pixels()}, evict=["a"])
    too_long.prompt_token_ids = list(range(1, 300))  # past max_model_len
    engine.add_request(too_long)
    assert finish_reasons(run(engine))["too-long"] == "error"
    assert engine.pixel_store.keys() == {"b"}


def test_an_item_sent_by_hash_the_store_lacks_fails_its_request_at_once(caplog):
    engine = make_engine()
    with caplog.at_level(logging.ERROR, "mmserve.engine_core"):
        engine.add_request(request("lost", image("nowhere")))
    [step] = run(engine)
    [output] = step.outputs
    assert output.finish_reason == "error" and "internal error" in output.error
    assert "nowhere" in caplog.text
    assert not engine.has_work()


def test_nothing_asks_the_frontend_for_pixels():
    assert not hasattr(protocol, "PIXELS") and not hasattr(protocol, "encode_pixels")
    fields = set(protocol.EngineCoreOutputs.__struct_fields__)
    assert fields == {"outputs", "stats", "released_pixel_handles", "unreadable_pixels"}
    assert not hasattr(EngineCore, "supply_pixels")


def test_pixels_go_to_the_runner_only_in_the_step_that_encodes_them():
    engine = make_engine()
    engine.add_request(request("r", image("a"), image("b", offset=12), arrays={"a": pixels(), "b": pixels()}))
    run(engine)
    steps = engine.executor.steps
    assert [sorted(s.encoder_pixels) for s in steps] == [["a", "b"], []]
    assert all(
        not hasattr(f, "pixel_values") for s in steps for new in s.scheduled_new_reqs for f in new.mm_features
    )


@pytest.mark.parametrize("with_pixels", [(True, False), (False, True), (False, False), (True, True)])
def test_add_messages_carry_a_frame_for_each_array_and_nothing_else(with_pixels):
    features = [image(f"h{i}", 2 + 4 * i) for i in range(2)]
    arrays = {f.mm_hash: pixels(float(i)) for i, (f, has) in enumerate(zip(features, with_pixels)) if has}
    sent = request("r", *features, arrays=arrays, evict=["old"])
    frames = protocol.encode_add(sent)
    assert len(frames) == 2 + sum(with_pixels)
    received = protocol.decode_add([bytes(memoryview(f)) for f in frames])
    assert received.mm_features == features and received.mm_evict == ["old"]
    assert received.mm_arrays.keys() == arrays.keys()
    for mm_hash, array in arrays.items():
        np.testing.assert_array_equal(received.mm_arrays[mm_hash], array)


def test_features_are_immutable():
    feature = image("a")
    with pytest.raises(AttributeError):
        feature.offset = 3


def test_outputs_with_image_news_round_trip():
    outputs = protocol.EngineCoreOutputs(released_pixel_handles=[3, 1], unreadable_pixels=["h"])
    decoded = protocol.decode_outputs(protocol.encode_outputs(outputs))
    assert decoded.released_pixel_handles == [3, 1] and decoded.unreadable_pixels == ["h"]
