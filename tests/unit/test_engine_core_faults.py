"""EngineCore survives faults: a failing model step fails only that step's requests, and image
metadata that could not come from the preprocessor is rejected at admission."""

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
    that schedules a request whose id starts with "poison"."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if any(r.startswith("poison") for r in so.num_scheduled_tokens):
            raise RuntimeError("boom")
        ids = list(so.num_scheduled_tokens)
        tokens = []
        for rid in ids:
            request = self.scheduler.requests[rid]
            tokens.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(ids, tokens)


def make_engine() -> EngineCore:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4),
        num_blocks=128,
        encoder_budget=64,
        encoder_cache_size=64,
    )
    return EngineCore(scheduler, FlakyExecutor(scheduler))


def request(rid: str, features=(), num_tokens: int = 10, max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=list(range(1, num_tokens + 1)),
        mm_features=list(features),
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens),
        arrival_time=time.monotonic(),
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


def test_a_failing_step_fails_its_requests_and_the_engine_serves_later_ones():
    engine = make_engine()
    engine.add_request(request("poison-1"))
    engine.add_request(request("victim"))  # scheduled in the same step: it fails too
    results = run(engine)
    assert results["poison-1"][1] == "error" and "internal error" in results["poison-1"][2]
    assert results["victim"][1] == "error"
    engine.add_request(request("later"))
    results = run(engine)
    assert results["later"] == ([7, 7, 7], "length", None)
    assert engine.scheduler.kv.num_used_blocks == 0


def test_inconsistent_image_metadata_is_rejected_at_admission():
    engine = make_engine()
    good_pixels = np.zeros((16, 12), dtype=np.float32)
    bad = {
        "span_past_the_prompt": MultiModalFeature("a", 8, 4, (1, 4, 4), good_pixels),
        "grid_not_matching_tokens": MultiModalFeature("b", 2, 3, (1, 4, 4), good_pixels),
        "pixels_not_matching_grid": MultiModalFeature("c", 2, 4, (1, 4, 4), np.zeros((10, 12), np.float32)),
    }
    for name, feature in bad.items():
        engine.add_request(request(name, [feature]))
    engine.add_request(request("fine", [MultiModalFeature("d", 2, 4, (1, 4, 4), good_pixels)]))
    results = run(engine)
    for name in bad:
        assert results[name][1] == "error", name
    assert results["fine"][1] == "length"
