"""Structured outputs in the scheduler (core/grammar.py), with a fake grammar tracker: a
request is never scheduled before its grammar compiled, its tokens advance its matcher in
order (after preemption too), each step's bitmask covers exactly the structured requests that
sample in it, and a finished grammar, a rejected token or a failed compile end the request."""

from __future__ import annotations

import numpy as np
from scheduler_harness import Harness, text

from mmserve.core.grammar import GrammarGate
from mmserve.sampling_params import StructuredOutputsParams

JSON = StructuredOutputsParams(json={"type": "object"})


class FakeTracker:
    """Compiles when told; accepts tokens except `rejected`; ends after `length` tokens."""

    def __init__(self, length: int = 1000, rejected: frozenset[int] = frozenset()) -> None:
        self.length, self.rejected = length, rejected
        self.ready: set[str] = set()
        self.errors: dict[str, str] = {}
        self.accepted: dict[str, list[int]] = {}
        self.bitmask_requests: list[list[str]] = []
        self.syncs = 0

    def add_request(self, request_id, spec, stop_token_ids) -> None:
        self.accepted[request_id] = []

    def is_ready(self, request_id) -> bool:
        return request_id in self.ready

    def start(self, request_id) -> str | None:
        return self.errors.get(request_id)

    def accept_token(self, request_id, token_id) -> bool:
        if token_id in self.rejected:
            return False
        self.accepted[request_id].append(token_id)
        return True

    def is_terminated(self, request_id) -> bool:
        return len(self.accepted[request_id]) >= self.length

    def sync(self, request_id, output_token_ids) -> bool:
        self.syncs += 1
        assert self.accepted[request_id] == list(output_token_ids)
        return True

    def fill_bitmask(self, request_ids):
        self.bitmask_requests.append(list(request_ids))
        return np.full((len(request_ids), 2), -1, dtype=np.int32)

    def remove(self, request_id) -> None:
        self.accepted.pop(request_id, None)


def harness(tracker: FakeTracker, **options) -> Harness:
    h = Harness(**options)
    h.scheduler.grammar = GrammarGate(tracker)
    return h


def test_a_request_waits_for_its_grammar_while_others_run():
    tracker = FakeTracker()
    h = harness(tracker)
    h.add("s", text(5), max_tokens=3, structured_outputs=JSON)
    h.add("plain", text(5), max_tokens=3)
    for _ in range(4):
        assert "s" not in h.step().num_scheduled_tokens
    assert h.results["plain"].finish_reason == "length"
    tracker.ready.add("s")
    h.run()
    assert (h.results["s"].tokens, h.results["s"].finish_reason) == h.expected("s")
    assert tracker.bitmask_requests == [["s"]] * 3  # one row per sampling step, only for "s"


def test_the_bitmask_covers_only_structured_requests_that_sample_this_step():
    tracker = FakeTracker()
    h = harness(tracker, max_num_batched_tokens=6)
    tracker.ready.add("s")
    h.add("s", text(14), max_tokens=2, structured_outputs=JSON)  # three steps of prefill
    h.add("plain", text(3), max_tokens=4)
    h.run()
    assert all(ids == ["s"] for ids in tracker.bitmask_requests)
    assert len(tracker.bitmask_requests) == len(h.results["s"].tokens) == 2


def test_a_finished_grammar_stops_the_request():
    tracker = FakeTracker(length=2)
    h = harness(tracker)
    tracker.ready.add("s")
    h.add("s", text(4), max_tokens=10, structured_outputs=JSON)
    h.run()
    assert h.results["s"].finish_reason == "stop" and len(h.results["s"].tokens) == 2


def test_a_failed_compile_fails_only_that_request():
    tracker = FakeTracker()
    h = harness(tracker)
    h.add("bad", text(4), max_tokens=3, structured_outputs=JSON)
    tracker.errors["bad"] = "no grammar"
    tracker.ready.add("bad")
    h.add("plain", text(4), max_tokens=3)
    h.run()
    assert h.results["bad"].finish_reason == "error" and h.results["plain"].finish_reason == "length"
    h.check_all_freed()


def test_a_token_the_grammar_rejects_fails_the_request():
    plain = harness(FakeTracker())
    plain.add("r", text(4), max_tokens=3)
    first = plain.expected("r")[0][0]
    tracker = FakeTracker(rejected=frozenset({first}))
    h = harness(tracker)
    tracker.ready.add("r")
    h.add("r", text(4), max_tokens=3, structured_outputs=JSON)
    h.run()
    assert h.results["r"].finish_reason == "error" and h.results["r"].tokens == [first]
    h.check_all_freed()


def test_preempted_structured_requests_resume_with_their_matchers_in_step():
    tracker = FakeTracker()
    h = harness(tracker, num_blocks=10, block_size=4, max_num_batched_tokens=64)
    for i in range(4):
        tracker.ready.add(f"s{i}")
        h.add(f"s{i}", text(6 + i), max_tokens=8, structured_outputs=JSON)
    h.run()
    assert h.scheduler.num_preemptions > 0
    for request_id, result in h.results.items():
        assert (result.tokens, result.finish_reason) == h.expected(request_id)
    assert tracker.syncs > 0  # each sampling step checked the matcher against the tokens


def test_aborting_a_request_that_waits_for_its_grammar_forgets_it():
    tracker = FakeTracker()
    h = harness(tracker)
    h.add("s", text(4), structured_outputs=JSON)
    h.step()
    h.abort("s")
    assert not h.scheduler.has_unfinished_requests() and "s" not in tracker.accepted
