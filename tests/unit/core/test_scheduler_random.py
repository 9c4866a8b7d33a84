"""Random workloads through the scheduler: whatever the budgets, cache sizes, policy, arrivals,
aborts and failing steps, every request ends with the tokens an unconstrained run produces (or
fails only for a reason of its own), and everything is freed."""

from __future__ import annotations

import pytest
from core_helpers import IMAGE_TOKEN, Image
from fake_runner import EOS, VOCAB
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_harness import Harness, text

IMAGES = {"img-a": 3, "img-b": 5, "img-c": 8, "img-d": 4}
PREFIXES = [text(5, start=10), text(9, start=20), [*text(3, start=30), IMAGE_TOKEN]]


@st.composite
def prompt_parts(draw) -> list:
    parts: list = []
    if draw(st.integers(0, 3)):
        parts.append(draw(st.sampled_from(PREFIXES)))
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 2)):
            name = draw(st.sampled_from(sorted(IMAGES)))
            parts.append(Image(name, IMAGES[name]))
        else:
            parts.append(draw(st.lists(st.integers(2, 9), min_size=1, max_size=6)))
    if not parts or isinstance(parts[-1], Image):
        parts.append(draw(st.lists(st.integers(2, 9), min_size=1, max_size=3)))
    return parts


@st.composite
def scenarios(draw) -> dict:
    config = dict(
        block_size=draw(st.sampled_from([2, 4])),
        num_blocks=draw(st.integers(5, 12)),
        max_num_batched_tokens=draw(st.integers(3, 24)),
        max_num_seqs=draw(st.integers(1, 5)),
        encoder_budget=draw(st.sampled_from([8, 12])),
        encoder_cache_size=draw(st.sampled_from([8, 13, 40])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
        max_model_len=draw(st.sampled_from([30, 64])),
    )
    requests = []
    for i in range(draw(st.integers(2, 8))):
        requests.append(
            dict(
                request_id=f"r{i}",
                parts=draw(prompt_parts()),
                arrival_step=draw(st.integers(0, 3)),
                abort_step=draw(st.none() | st.none() | st.integers(0, 20)),
                priority=draw(st.integers(0, 2)),
                max_tokens=draw(st.integers(1, 14)),
                min_tokens=draw(st.integers(0, 1)),
                stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
                ignore_eos=draw(st.booleans()),
                poison=draw(st.sampled_from([False] * 5 + [True])),
            )
        )
    return dict(config=config, requests=requests)


def assert_expected_outcomes(h: Harness, rejected: set[str]) -> None:
    """Every request ends as an unconstrained run would, or fails only for a reason of its own."""
    block_capacity = h.scheduler.kv.pool.num_blocks * h.scheduler.block_size
    for request_id, result in h.results.items():
        want_tokens, want_reason = h.expected(request_id)
        prompt, _, _ = h.prompts[request_id]
        if request_id in h.poison and request_id not in rejected:
            # It raises whenever it runs: it fails alone, or is aborted first; nobody else fails.
            assert result.finish_reason in ("error", "abort") and result.tokens == [], (request_id, result)
        elif result.finish_reason == "abort":
            assert result.tokens == want_tokens[: len(result.tokens)]
        elif result.finish_reason == "error":
            # Only a request that alone outgrows the KV cache may fail.
            assert len(prompt) + len(want_tokens) > block_capacity, result.error
            assert result.tokens == want_tokens[: len(result.tokens)]
        else:
            assert (result.tokens, result.finish_reason) == (want_tokens, want_reason), request_id


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_finish_with_the_expected_tokens_and_free_everything(scenario):
    h = Harness(**scenario["config"])
    arrivals: dict[int, list[dict]] = {}
    aborts: dict[int, list[str]] = {}
    for spec in scenario["requests"]:
        arrivals.setdefault(spec["arrival_step"], []).append(spec)
        if spec["abort_step"] is not None:
            aborts.setdefault(spec["abort_step"], []).append(spec["request_id"])
    rejected = set()
    step = 0
    while step <= 6 or h.scheduler.has_unfinished_requests():
        assert step < 400, "requests still unfinished after 400 steps"
        for spec in arrivals.get(step, []):
            try:
                h.add(
                    spec["request_id"],
                    *spec["parts"],
                    priority=spec["priority"],
                    max_tokens=spec["max_tokens"],
                    min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                    stop_token_ids=spec["stop_token_ids"],
                    eos_token_ids=[EOS],
                    ignore_eos=spec["ignore_eos"],
                )
            except ValueError:
                rejected.add(spec["request_id"])
            if spec["poison"]:
                h.poison.add(spec["request_id"])
        h.abort(*[request_id for request_id in aborts.get(step, []) if request_id in h.results])
        had_work = h.scheduler.has_unfinished_requests()
        num_preemptions, num_finished = h.scheduler.num_preemptions, len(h.finish_order)
        scheduler_output = h.step()
        # Nothing outside changes the state between steps, so a step without progress repeats forever.
        assert not had_work or (
            scheduler_output.total_num_scheduled_tokens
            or h.scheduler.num_preemptions > num_preemptions
            or len(h.finish_order) > num_finished
        ), "a step made no progress: the scheduler is stuck"
        step += 1

    assert_expected_outcomes(h, rejected)
    stats = h.scheduler.stats()
    event(f"preemptions: {min(stats.num_preemptions, 3)}")
    event(f"encoder cache hits: {min(stats.encoder_cache_hits, 2)}")
    event(f"prefix cache hits: {stats.prefix_cache_hits > 0}")
    event(f"rejected at admission: {len(rejected)}")
    event(f"poisoned requests: {min(len(h.poison - rejected), 2)}")
    for reason in ("abort", "error", "stop"):
        event(f"{reason}: {any(r.finish_reason == reason for r in h.results.values())}")
    h.check_all_freed()


def test_the_oracle_agrees_with_an_unconstrained_run():
    h = Harness(num_blocks=256, max_num_batched_tokens=1024, encoder_budget=64)
    h.add("a", text(3), Image("img-a", 8), text(3), max_tokens=12)
    h.add("b", text(3), Image("img-a", 8), text(9), max_tokens=12)
    h.run()
    assert h.scheduler.num_preemptions == 0
    for request_id in h.results:
        assert (h.results[request_id].tokens, h.results[request_id].finish_reason) == h.expected(request_id)


@pytest.mark.parametrize("seed", range(3))
def test_constrained_and_unconstrained_runs_return_the_same_tokens(seed):
    def workload(h: Harness) -> dict[str, tuple[list[int], str | None]]:
        for i in range(6):
            img = Image(f"img-{(i + seed) % 3}", 4 + i % 3)
            h.add(f"r{i}", PREFIXES[i % 2], img, text(2 + i, start=i), max_tokens=6 + i)
        return {request_id: (r.tokens, r.finish_reason) for request_id, r in h.run().items()}

    free = workload(Harness(num_blocks=512, max_num_batched_tokens=2048, encoder_budget=64))
    tight = Harness(
        num_blocks=12, max_num_batched_tokens=7, max_num_seqs=3, encoder_budget=8, encoder_cache_size=12
    )
    assert workload(tight) == free
    assert tight.scheduler.num_preemptions > 0
    tight.check_all_freed()
