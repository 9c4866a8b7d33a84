"""Scheduling policies: each waiting queue admits in its policy's order, keeps `running` in the
order it serves, and names the victim; the priority queue's lazy deletion stays invisible."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core.request import Request
from mmserve.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from mmserve.core.scheduler import Scheduler
from mmserve.sampling_params import SamplingParams


def make_request(request_id: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(request_id, [1, 2, 3], [], SamplingParams(), 4, arrival_time, priority)


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# ---------------------------------------------------------------------------- choosing a policy


def test_the_config_defaults_to_fcfs_and_the_scheduler_takes_its_policy_from_it():
    assert SchedulerConfig().scheduling_policy == "fcfs"
    for policy, queue_type in (("fcfs", FCFSRequestQueue), ("priority", PriorityRequestQueue)):
        config = SchedulerConfig(scheduling_policy=policy)
        scheduler = Scheduler(config, CacheConfig(block_size=4), 8, encoder_budget=8, encoder_cache_size=8)
        assert type(scheduler.waiting) is queue_type


def test_an_unknown_policy_is_a_clear_error_in_the_config_and_the_factory():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        create_request_queue("lifo")


# ---------------------------------------------------------------------------- FCFS


def test_fcfs_admits_in_arrival_order_and_a_preempted_request_goes_first():
    queue = create_request_queue("fcfs")
    for request_id in ("a", "b", "c"):
        queue.push(make_request(request_id, priority=ord(request_id)))
    preempted = make_request("p", priority=99)
    queue.push_front(preempted)
    assert ids(queue) == ["p", "a", "b", "c"] and len(queue) == 4
    assert queue.pop() is preempted and queue.peek().request_id == "a"


def test_fcfs_running_is_admission_order_and_the_victim_is_the_last_admitted():
    queue = create_request_queue("fcfs")
    running: list[Request] = []
    for request_id, priority in (("a", 5), ("b", 0), ("c", 2)):
        queue.add_running(running, make_request(request_id, priority))
    assert ids(running) == ["a", "b", "c"]
    assert queue.choose_victim(running).request_id == "c"
    assert queue.choose_victim(running[:2]).request_id == "b"


# ---------------------------------------------------------------------------- priority


def test_priority_admits_by_priority_then_arrival():
    queue = create_request_queue("priority")
    for request_id, priority, arrival in (("late", 0, 5.0), ("low", 3, 0.0), ("early", 0, 1.0)):
        queue.push(make_request(request_id, priority, arrival))
    assert ids(queue) == ["early", "late", "low"]
    assert [queue.pop().request_id for _ in range(3)] == ["early", "late", "low"]
    assert not queue


def test_priority_running_is_most_urgent_first_and_the_victim_is_the_least_urgent():
    queue = create_request_queue("priority")
    running: list[Request] = []
    for request_id, priority, arrival in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 2, 2.0), ("d", 1, 3.0)):
        queue.add_running(running, make_request(request_id, priority, arrival))
    assert ids(running) == ["b", "d", "a", "c"]
    assert queue.choose_victim(running).request_id == "c"
    assert queue.choose_victim(running[:2]).request_id == "d"


def test_priority_remove_hides_the_request_from_every_view():
    queue = create_request_queue("priority")
    requests = [make_request(f"r{i}", priority=i) for i in range(4)]
    for request in requests:
        queue.push(request)
    queue.remove(requests[0])  # the head
    queue.remove(requests[2])  # the middle
    assert len(queue) == 2 and ids(queue) == ["r1", "r3"] and queue.peek() is requests[1]
    queue.push(requests[0])  # back after removal: one live entry only
    assert ids(queue) == ["r0", "r1", "r3"]
    with pytest.raises(ValueError, match="not queued"):
        queue.remove(requests[2])
    with pytest.raises(ValueError, match="already queued"):
        queue.push(requests[1])
    for request in (requests[0], requests[1], requests[3]):
        queue.remove(request)
    assert not queue and list(queue) == []
    with pytest.raises(IndexError):
        queue.peek()


def test_priority_queue_stays_right_through_many_removals_away_from_the_head():
    queue = create_request_queue("priority")
    requests = [make_request(f"r{i:02}", priority=i) for i in range(40)]
    for request in requests:
        queue.push(request)
    for request in requests[39:4:-1]:  # dead entries pile up below the head until compacted
        queue.remove(request)
    assert len(queue) == 5 and ids(queue) == ids(requests[:5])
    assert [queue.pop().request_id for _ in range(5)] == ids(requests[:5])
    assert not queue


# ---------------------------------------------------------------------------- property


class RequestQueueMachine(RuleBasedStateMachine):
    """Random push / push_front / pop / remove sequences against a plain list kept in the
    policy's order; every view of the queue (len, bool, iteration, peek) must agree with it."""

    POLICY = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.queue = create_request_queue(self.POLICY)
        self.model: list[Request] = []
        self.outside = [make_request(f"r{i}", i % 3, float(i // 2)) for i in range(8)]

    def order(self, request: Request, front: bool) -> None:
        """Insert into the model where the policy puts it."""
        if self.POLICY == "fcfs":
            self.model.insert(0 if front else len(self.model), request)
        else:
            self.model.append(request)  # stable: equal keys keep push order
            self.model.sort(key=lambda r: (r.priority, r.arrival_time))

    @precondition(lambda self: self.outside)
    @rule(data=st.data(), front=st.booleans())
    def push(self, data, front):
        request = self.outside.pop(data.draw(st.integers(0, len(self.outside) - 1)))
        (self.queue.push_front if front else self.queue.push)(request)
        self.order(request, front)

    @precondition(lambda self: self.model)
    @rule()
    def pop(self):
        request = self.queue.pop()
        assert request is self.model.pop(0)
        self.outside.append(request)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        request = data.draw(st.sampled_from(self.model))
        self.queue.remove(request)
        self.model.remove(request)
        self.outside.append(request)

    @invariant()
    def views_agree(self):
        assert len(self.queue) == len(self.model)
        assert bool(self.queue) == bool(self.model)
        assert ids(self.queue) == ids(self.model)
        if self.model:
            assert self.queue.peek() is self.model[0]


class PriorityRequestQueueMachine(RequestQueueMachine):
    POLICY = "priority"


TestFCFSRequestQueue = RequestQueueMachine.TestCase
TestFCFSRequestQueue.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestPriorityRequestQueue = PriorityRequestQueueMachine.TestCase
TestPriorityRequestQueue.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
