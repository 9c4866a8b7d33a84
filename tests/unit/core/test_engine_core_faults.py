"""EngineCore survives faults: a failing model step fails only the request that causes it (its
batch-mates are recomputed alone and finish normally), nothing the failed step computed is
trusted afterwards, and image metadata that could not come from the preprocessor is rejected at
admission."""

from __future__ import annotations

import time

import numpy as np

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.engine_core import EngineCore
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.protocol import EngineRequest, MultiModalFeature
from mmserve.sampling_params import SamplingParams


class FlakyExecutor:
    """Samples token 7 for every request that finished its known tokens; raises on any step
    that schedules a request whose id starts with "poison". Records each step's request ids."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[list[str]] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(list(scheduler_output.num_scheduled_tokens))
        if any(r.startswith("poison") for r in scheduler_output.num_scheduled_tokens):
            raise RuntimeError("boom")
        ids = list(scheduler_output.num_scheduled_tokens)
        tokens = []
        for request_id in ids:
            request = self.scheduler.requests[request_id]
            tokens.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(ids, tokens)


def make_engine(max_num_batched_tokens: int = 64) -> EngineCore:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, max_model_len=256),
        CacheConfig(block_size=4),
        num_blocks=128,
        encoder_budget=64,
        encoder_cache_size=64,
    )
    return EngineCore(scheduler, FlakyExecutor(scheduler))


def request(
    request_id: str, features=(), num_tokens: int = 10, max_tokens: int = 3, pixels: np.ndarray | None = None
) -> EngineRequest:
    """`pixels`: what every feature brings (the request's items are stored with them)."""
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, num_tokens + 1)),
        mm_features=list(features),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        arrival_time=time.monotonic(),
        mm_arrays={f.mm_hash: pixels for f in features} if pixels is not None else {},
    )


def run(engine: EngineCore, max_steps: int = 50) -> dict[str, tuple[list[int], str | None, str | None]]:
    results: dict[str, tuple[list[int], str | None, str | None]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step().outputs:
            tokens, _, _ = results.get(out.request_id, ([], None, None))
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason, out.error)
    return results


def test_a_failing_step_fails_only_its_culprit_and_its_batch_mates_finish_normally():
    engine = make_engine()
    engine.add_request(request("victim-1"))
    engine.add_request(request("poison-1"))
    engine.add_request(request("victim-2"))  # all three share the first step, which raises
    results = run(engine)
    assert results["poison-1"][1] == "error" and "internal error" in results["poison-1"][2]
    assert results["victim-1"] == ([7, 7, 7], "length", None)
    assert results["victim-2"] == ([7, 7, 7], "length", None)
    steps = engine.executor.steps
    assert steps[0] == ["victim-1", "poison-1", "victim-2"]
    assert steps[1:4] == [["victim-1"], ["poison-1"], ["victim-2"]]  # each alone, in order
    assert engine.scheduler.step_recovery.isolated == {}
    engine.add_request(request("later"))
    results = run(engine)
    assert results["later"] == ([7, 7, 7], "length", None)
    assert engine.scheduler.kv.num_used_blocks == 0
    assert engine.scheduler.encoder_cache_manager.num_references() == 0


def test_a_request_that_fails_in_a_later_chunk_is_found_and_the_others_are_served_meanwhile():
    """The failed step comes after several good ones (chunked prefill): isolation replays each
    request alone only up to where that step reached."""
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request(request("victim", num_tokens=40))
    engine.add_request(request("poison-late", num_tokens=8))
    results = run(engine, max_steps=100)
    assert results["poison-late"][1] == "error"
    assert results["victim"] == ([7, 7, 7], "length", None)
    assert engine.scheduler.kv.num_used_blocks == 0


def test_blocks_filled_by_a_failed_step_are_never_prefix_hits():
    engine = make_engine()
    engine.add_request(request("poison-prefill", num_tokens=12))  # 3 full blocks of 4, then it fails
    run(engine)
    engine.add_request(request("same-prompt", num_tokens=12))
    results = run(engine)
    assert results["same-prompt"] == ([7, 7, 7], "length", None)
    assert engine.scheduler.kv.prefix_stats.hits == 0  # 8 tokens would hit had the blocks kept their hashes


def test_images_encoded_in_a_failed_step_leave_the_encoder_cache():
    engine = make_engine()
    pixels = np.zeros((16, 12), dtype=np.float32)
    engine.add_request(request("poison-image", [MultiModalFeature("img", 2, 4, (1, 4, 4))], pixels=pixels))
    run(engine)
    cache = engine.scheduler.encoder_cache_manager
    assert not cache.is_cached("img")
    assert cache.num_free_slots == cache.cache_size
    engine.add_request(request("same-image", [MultiModalFeature("img", 2, 4, (1, 4, 4))]))  # by hash
    results = run(engine)
    assert results["same-image"][1] == "length"
    assert engine.scheduler.num_encoder_runs == 2  # encoded again, not served from a stale entry


def test_inconsistent_image_metadata_is_rejected_at_admission():
    engine = make_engine()
    good_pixels = np.zeros((16, 12), dtype=np.float32)
    bad = {
        "span_past_the_prompt": (MultiModalFeature("a", 8, 4, (1, 4, 4)), good_pixels),
        "grid_not_matching_tokens": (MultiModalFeature("b", 2, 3, (1, 4, 4)), good_pixels),
        "pixels_not_matching_grid": (MultiModalFeature("c", 2, 4, (1, 4, 4)), np.zeros((10, 12), np.float32)),
    }
    for name, (feature, pixels) in bad.items():
        engine.add_request(request(name, [feature], pixels=pixels))
    engine.add_request(request("fine", [MultiModalFeature("d", 2, 4, (1, 4, 4))], pixels=good_pixels))
    results = run(engine)
    for name in bad:
        assert results[name][1] == "error", name
    assert results["fine"][1] == "length"
    # a rejected request's pixels are stored all the same: the frontend's mirror lists them
    assert engine.pixel_store.keys() == {"a", "b", "c", "d"}
