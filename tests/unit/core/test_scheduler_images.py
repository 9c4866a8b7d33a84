"""The scheduler with images and the prefix cache: an image is encoded once, the whole item, the
first time any of its tokens is scheduled, stays cached while requests need it, and a prompt
starts after its longest cached prefix (see test_scheduler.py for the bench)."""

from __future__ import annotations

import pytest
from core_helpers import Image, build_prompt
from fake_runner import FakeRunner
from scheduler_harness import Harness, engine_request, text

from mmserve.core.engine_core import EngineCore
from mmserve.sampling_params import SamplingParams

# ============================================================================ images


def test_chunked_prefill_splits_an_image_and_encodes_it_once_in_its_first_step():
    h = Harness(max_num_batched_tokens=8, encoder_budget=16)
    h.add("r", text(6), Image("img-a", 16), text(5))
    spans = [h.step() for _ in range(4)]
    assert [scheduler_output.num_scheduled_tokens["r"] for scheduler_output in spans] == [8, 8, 8, 3]
    assert spans[0].scheduled_encoder_inputs == {"r": [0]}
    assert all(not scheduler_output.scheduled_encoder_inputs for scheduler_output in spans[1:])
    assert h.encodes_of("img-a") == [(0, "r", "img-a")]
    h.run()
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == h.expected("r")


def test_span_stops_before_an_uncached_image_when_others_used_the_encoder_budget():
    h = Harness(max_num_batched_tokens=64, encoder_budget=10, encoder_cache_size=20)
    h.add("a", text(2), Image("img-a", 8), text(2))
    h.add("b", text(3), Image("img-b", 8), text(2))
    first = h.step()
    assert first.num_scheduled_tokens == {"a": 12, "b": 3}  # b stops just before its image
    assert first.scheduled_encoder_inputs == {"a": [0]}
    second = h.step()
    assert second.num_scheduled_tokens["b"] == 10
    assert second.scheduled_encoder_inputs == {"b": [0]}
    h.run()
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)


def test_span_stops_before_an_image_that_does_not_fit_the_encoder_cache_yet():
    h = Harness(max_num_batched_tokens=8, encoder_budget=10, encoder_cache_size=10)
    h.add("a", Image("img-a", 10), text(2))
    h.add("b", text(2), Image("img-b", 10))
    assert h.step().num_scheduled_tokens == {"a": 8}
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 2}  # b stops: the cache holds img-a
    assert h.step().num_scheduled_tokens == {"a": 1, "b": 7}  # a is past img-a: evicted for img-b
    assert h.runner.encodes == [(0, "a", "img-a"), (2, "b", "img-b")]
    h.run()
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)


@pytest.mark.parametrize(("encoder_budget", "encoder_cache_size"), [(8, 64), (64, 8)])
def test_image_larger_than_the_encoder_budget_or_cache_is_rejected_at_admission(
    encoder_budget, encoder_cache_size
):
    h = Harness(encoder_budget=encoder_budget, encoder_cache_size=encoder_cache_size)
    with pytest.raises(ValueError, match="an image needs 9 tokens"):
        h.add("r", text(2), Image("img-a", 9))
    assert not h.scheduler.has_unfinished_requests()


def test_engine_core_answers_an_unschedulable_request_with_an_error_output():
    sched = Harness(encoder_budget=8).scheduler
    core = EngineCore(sched, FakeRunner(sched.block_size))
    prompt, features = build_prompt(text(2), Image("img-a", 9))
    core.add_request(engine_request("r", prompt, features, SamplingParams()))
    outputs = core.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r", "error")]
    assert "encoder budget" in outputs[0].error
    assert not core.has_work()


def test_second_request_with_a_cached_image_does_not_encode_it_again():
    h = Harness()
    h.add("a", text(3), Image("img-a", 8), text(2))
    h.run()
    h.add("b", text(5, start=30), Image("img-a", 8), text(2))
    h.run()
    assert len(h.encodes_of("img-a")) == 1
    assert h.scheduler.encoder_cache_manager.num_hits == 1
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_two_requests_with_the_same_image_in_one_step_encode_it_once():
    h = Harness()
    h.add("a", text(3), Image("img-a", 8))
    h.add("b", text(4, start=20), Image("img-a", 8))
    scheduler_output = h.step()
    assert set(scheduler_output.num_scheduled_tokens) == {"a", "b"}
    assert scheduler_output.scheduled_encoder_inputs == {"a": [0]}
    h.run()
    assert len(h.encodes_of("img-a")) == 1
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)


def test_the_same_image_twice_in_one_prompt_is_encoded_once():
    h = Harness(max_num_batched_tokens=6)
    h.add("r", text(2), Image("img-a", 5), text(3), Image("img-a", 5), text(2))
    h.run()
    assert len(h.encodes_of("img-a")) == 1
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == h.expected("r")


def test_encoder_reference_is_released_once_the_request_computes_past_the_image():
    h = Harness(max_num_batched_tokens=8)
    h.add("r", text(2), Image("img-a", 8), text(20))
    manager = h.scheduler.encoder_cache_manager
    h.step()  # tokens 0..8: mid-image
    assert manager.refs["img-a"] == {"r"}
    h.step()  # tokens 8..16: past the image's end (10)
    assert h.scheduler.running and manager.num_references() == 0
    assert manager.is_cached("img-a")  # still cached for a later request, just unreferenced


def test_cached_image_is_not_evicted_for_another_image_the_same_span_needs():
    # The span covers img-b (cached, unreferenced) and img-c (to encode, needing all the room but
    # img-b's): the plan must not count img-b as evictable, so the span stops before img-c.
    h = Harness(max_num_batched_tokens=64, encoder_budget=16, encoder_cache_size=16)
    h.add("a", Image("img-b", 8), text(2))
    h.run()
    assert h.scheduler.encoder_cache_manager.unreferenced == {"img-b": None}
    h.add("b", text(2), Image("img-b", 8), text(2), Image("img-c", 10), text(2))
    h.run()
    assert len(h.encodes_of("img-b")) == 1
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")
    h.check_all_freed()


def test_a_repeated_image_is_encoded_again_when_the_image_between_needed_its_room():
    # The cache holds one image: img-b evicts img-a, which is encoded again at its second
    # occurrence instead of pinning the cache (and the request) forever.
    h = Harness(encoder_budget=12, encoder_cache_size=12)
    h.add("r", Image("img-a", 8), text(2), Image("img-b", 8), text(2), Image("img-a", 8), text(1))
    h.run()
    assert [e[2] for e in h.runner.encodes] == ["img-a", "img-b", "img-a"]
    assert (h.results["r"].tokens, h.results["r"].finish_reason) == h.expected("r")
    h.check_all_freed()


def test_requests_repeating_images_do_not_deadlock_the_encoder_cache():
    # Each request alone fits the cache (13), but holding img-x and img-y across their gaps
    # would leave 3 free embeddings while both wait for room for an 8-token image.
    h = Harness(
        max_num_batched_tokens=6, long_prefill_token_threshold=3, encoder_budget=13, encoder_cache_size=13
    )
    h.add("r1", Image("img-x", 5), text(2), Image("img-z", 8), text(2), Image("img-x", 5), text(1))
    h.add("r2", Image("img-y", 5), text(2, start=20), Image("img-w", 8), text(2), Image("img-y", 5), text(1))
    h.run(max_steps=100)
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)
    h.check_all_freed()


# ============================================================================ prefix cache


def test_request_sharing_a_prefix_starts_after_the_cached_blocks():
    h = Harness()
    h.add("a", text(4), Image("img-a", 8), text(6))
    h.run()
    h.add("b", text(4), Image("img-a", 8), text(6), [7, 7])
    scheduler_output = h.step()
    assert scheduler_output.num_scheduled_tokens == {"b": 2 + 2}  # 16 of 20 tokens come from the cache
    h.run()
    assert h.results["b"].num_cached_tokens == 16
    assert not h.encodes_of("img-a")[1:]
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_same_text_with_a_different_image_recomputes_from_the_image_on():
    h = Harness()
    h.add("a", text(6), Image("img-a", 8), text(6))
    h.run()
    h.add("b", text(6), Image("img-b", 8), text(6))
    h.run()
    assert h.results["b"].num_cached_tokens == 4  # the one block before the image
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_prefix_hit_ending_inside_an_evicted_image_encodes_the_image_again():
    h = Harness(encoder_budget=8, encoder_cache_size=8)
    h.add("a", text(2), Image("img-a", 8), text(6))
    h.run()
    h.add("c", Image("img-c", 8), text(2))  # evicts img-a from the encoder cache
    h.run()
    h.add("b", text(2), Image("img-a", 8), text(6, start=30))
    scheduler_output = h.step()
    assert h.results["b"].num_cached_tokens == 8  # two blocks: the hit ends inside the image
    assert scheduler_output.scheduled_encoder_inputs == {"b": [0]}
    h.run()
    assert [e[2] for e in h.runner.encodes] == ["img-a", "img-c", "img-a"]
    assert (h.results["b"].tokens, h.results["b"].finish_reason) == h.expected("b")


def test_a_cached_prefix_computed_in_the_same_step_is_shared():
    h = Harness()
    h.add("a", text(9), max_tokens=3)
    h.add("b", [*text(8), 40], max_tokens=3)
    scheduler_output = h.step()
    assert scheduler_output.num_scheduled_tokens == {"a": 9, "b": 1}  # b reads a's blocks, written this step
    h.run()
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)
