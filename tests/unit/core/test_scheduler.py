"""The scheduler's step decisions, freeing, preemption and stopping, driven step by step against
a fake model runner (no torch, no model).

The bench is in scheduler_harness.py and fake_runner.py: every scheduled run is checked against
an oracle that computes the same tokens without any scheduler. Images and the prefix cache are
tested in test_scheduler_images.py, random workloads in test_scheduler_random.py.
"""

from __future__ import annotations

import pytest
from core_helpers import Image, build_prompt
from fake_runner import EOS, FakeRunner, Sampler
from scheduler_harness import Harness, engine_request, text

from mmserve.core.engine_core import EngineCore
from mmserve.sampling_params import SamplingParams

# ============================================================================ the step decision


def test_each_step_respects_the_token_budget_and_max_num_seqs():
    h = Harness(max_num_batched_tokens=10, max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", text(7 + i), max_tokens=5)
    h.run()
    assert max(sum(d.values()) for d in h.decisions) == 10
    assert max(len(d) for d in h.decisions) == 2
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)
    h.check_all_freed()


def test_prompt_and_decode_tokens_share_one_budget():
    h = Harness(max_num_batched_tokens=10)
    h.add("a", text(6), max_tokens=8)
    h.step()  # a: its whole prompt
    h.add("b", text(30))
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 9}
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 9}


def test_running_requests_are_scheduled_before_waiting_ones():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", text(20))
    h.step()
    h.add("b", text(4))
    assert h.step().num_scheduled_tokens == {"a": 8}
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 4}


def test_waiting_requests_are_served_first_come_first_served():
    h = Harness(max_num_seqs=1)
    for request_id in ("c", "a", "b"):
        h.add(request_id, text(5), max_tokens=2)
    h.run()
    assert h.finish_order == ["c", "a", "b"]


def test_long_prefill_token_threshold_caps_one_requests_share():
    h = Harness(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    h.add("long", text(20))
    h.add("other", text(20, start=9))
    assert h.step().num_scheduled_tokens == {"long": 6, "other": 6}
    h.run()
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)


# ============================================================================ freeing


def test_finishing_frees_every_block_and_encoder_reference():
    h = Harness()
    h.add("a", text(5), Image("img-a", 8), text(3), max_tokens=6)
    h.add("b", text(9), max_tokens=3)
    h.run()
    assert {r.finish_reason for r in h.results.values()} <= {"length", "stop"}
    h.check_all_freed()


def test_aborting_a_waiting_request_frees_it():
    h = Harness(max_num_seqs=1)
    h.add("a", text(5), max_tokens=10)
    h.add("b", text(5), Image("img-b", 4))
    h.step()
    h.abort("b")
    assert h.results["b"].finish_reason == "abort"
    h.run()
    h.check_all_freed()


def test_aborting_a_running_request_mid_image_frees_its_blocks_and_encoder_reference():
    h = Harness(max_num_batched_tokens=6)
    h.add("a", text(2), Image("img-a", 12), text(3))
    h.step()
    assert h.scheduler.encoder_cache_manager.num_references() == 1
    h.abort("a")
    assert (h.results["a"].tokens, h.results["a"].finish_reason) == ([], "abort")
    assert h.scheduler.kv.num_used_blocks == 0
    assert h.scheduler.encoder_cache_manager.num_references() == 0
    assert h.scheduler.schedule().dropped_req_ids == {"a"}  # the runner drops its state
    assert h.scheduler.abort_requests(["a", "unknown"]) == []


def test_aborting_a_preempted_request_frees_it():
    h = Harness(num_blocks=6, max_num_batched_tokens=64)
    h.add("a", text(7), max_tokens=12)
    h.add("b", text(7, start=20), max_tokens=12)
    h.run_until(lambda: h.scheduler.num_preemptions > 0)
    (preempted,) = list(h.scheduler.waiting)
    h.abort(preempted.request_id)
    h.run()
    h.check_all_freed()


# ============================================================================ preemption


def test_preempted_request_completes_with_the_tokens_it_would_have_produced():
    h = Harness(num_blocks=10, max_num_batched_tokens=16)
    for i in range(4):
        h.add(f"r{i}", text(6, start=3 * i), Image(f"img-{i}", 4), text(2), max_tokens=14)
    h.run()
    assert h.scheduler.num_preemptions > 0
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)
    h.check_all_freed()


def test_preemption_takes_the_most_recently_admitted_request_under_fcfs():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    h.add("a", text(4), max_tokens=8)
    h.add("b", text(4, start=20), max_tokens=8)
    h.run_until(lambda: h.scheduler.num_preemptions > 0)
    assert [r.request_id for r in h.scheduler.running] == ["a"]
    h.run()
    assert h.finish_order == ["a", "b"]


def test_priority_policy_admits_the_most_urgent_request_first():
    h = Harness(max_num_seqs=1, scheduling_policy="priority")
    h.add("low", text(5), priority=5, max_tokens=2)
    h.add("high", text(5), priority=0, max_tokens=2)
    h.add("mid", text(5), priority=2, max_tokens=2)
    h.run()
    assert h.finish_order == ["high", "mid", "low"]


def test_priority_policy_preempts_the_least_urgent_running_request():
    h = Harness(num_blocks=6, max_num_batched_tokens=64, scheduling_policy="priority")
    h.add("low", text(2), priority=5, max_tokens=12)
    h.step()
    h.add("high", text(5, start=20), priority=0, max_tokens=12)  # runs out of blocks first
    h.run_until(lambda: h.scheduler.num_preemptions > 0)
    assert [r.request_id for r in h.scheduler.running] == ["high"]
    h.run()
    assert h.finish_order == ["high", "low"]
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)


def test_request_that_alone_can_never_fit_the_kv_cache_ends_with_an_error():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    h.add("r", text(10), max_tokens=20)
    h.run(max_steps=50)
    assert h.results["r"].finish_reason == "error"
    assert "KV cache" in h.results["r"].error
    assert h.results["r"].tokens == h.expected("r")[0][: len(h.results["r"].tokens)]
    h.check_all_freed()


def test_preempted_request_that_can_never_fit_ends_with_an_error_instead_of_waiting_forever():
    h = Harness(num_blocks=5, max_num_batched_tokens=64)
    h.add("big", text(10), max_tokens=20)  # needs more than 5 blocks of 4 in the end
    h.add("small", text(3), max_tokens=12)
    h.run(max_steps=100)
    assert h.results["big"].finish_reason == "error"
    assert (h.results["small"].tokens, h.results["small"].finish_reason) == h.expected("small")
    h.check_all_freed()


def test_prompt_larger_than_the_kv_cache_is_rejected_at_admission():
    h = Harness(num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        h.add("r", text(9))


# ============================================================================ engine core


def test_engine_core_steps_the_scheduler_and_reports_aborts_with_the_next_step():
    sched = Harness().scheduler
    core = EngineCore(sched, FakeRunner(sched.block_size))
    for request_id in ("a", "b"):
        prompt, features = build_prompt(text(3), Image("img-a", 4))
        core.add_request(engine_request(request_id, prompt, features, SamplingParams(max_tokens=3)))
    first = core.step()
    assert sorted(o.request_id for o in first.outputs) == ["a", "b"]
    assert first.stats.num_running == 2 and first.stats.encoder_runs == 1
    core.abort_requests(["b"])
    outputs = core.step().outputs
    assert outputs[0].request_id == "b" and outputs[0].finish_reason == "abort"
    while core.has_work():
        core.step()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_in_use) == (0, 0, 0)
    assert stats.encoder_cache_references == 0 and stats.encoder_cache_hits == 1


# ============================================================================ stopping


def test_max_tokens_stops_with_length():
    h = Harness()
    h.add("r", text(5), max_tokens=3)
    h.run()
    assert (len(h.results["r"].tokens), h.results["r"].finish_reason) == (3, "length")


def scripted(outputs: list[int], prompt_len: int) -> Sampler:
    """A sampler returning outputs[i] for the i-th generated token of a prompt_len prompt."""
    return lambda context: outputs[len(context) - prompt_len]


def test_eos_stops_with_stop_and_no_stop_reason():
    h = Harness(sampler=scripted([5, 6, EOS, 7, 8], 4))
    h.add("r", text(4), max_tokens=5, eos_token_ids=[EOS])
    h.run()
    r = h.results["r"]
    assert (r.tokens, r.finish_reason, r.stop_reason) == ([5, 6, EOS], "stop", None)


def test_ignore_eos_generates_past_eos():
    h = Harness(sampler=scripted([5, EOS, 7, 8], 4))
    h.add("r", text(4), max_tokens=4, eos_token_ids=[EOS], ignore_eos=True)
    h.run()
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == ([5, EOS, 7, 8], "length")


def test_stop_token_id_stops_and_is_reported_as_the_stop_reason():
    h = Harness(sampler=scripted([5, 42, 7], 4))
    h.add("r", text(4), max_tokens=3, stop_token_ids=[42])
    h.run()
    r = h.results["r"]
    assert (r.tokens, r.finish_reason, r.stop_reason) == ([5, 42], "stop", 42)


def test_min_tokens_ignores_stop_tokens_until_reached():
    h = Harness(sampler=scripted([EOS, 42, 7, EOS, 9], 4))
    h.add("r", text(4), max_tokens=5, min_tokens=3, stop_token_ids=[42], eos_token_ids=[EOS])
    h.run()
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == ([EOS, 42, 7, EOS], "stop")


def test_max_model_len_caps_the_output_with_length():
    h = Harness(max_model_len=10)
    h.add("r", text(7), max_tokens=None)
    h.run()
    assert (len(h.results["r"].tokens), h.results["r"].finish_reason) == (3, "length")


def test_prompt_that_fills_the_context_is_rejected():
    h = Harness(max_model_len=10)
    with pytest.raises(ValueError, match="context length"):
        h.add("r", text(10))
    with pytest.raises(ValueError, match="empty"):
        h.add("r", [])
