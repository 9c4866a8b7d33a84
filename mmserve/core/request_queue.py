"""Scheduling policies: the waiting queue, and the two choices a policy makes about `running`.

A policy decides three orders, so the scheduler tests none of them itself: which waiting request
is admitted next (`peek`/`pop`), where an admitted request joins the running list (which the
scheduler serves front to back), and which running request is preempted when KV blocks run out.

- FCFS: arrival order. Admitted requests join the back of `running`, the victim is the one
  admitted last, and a preempted request goes back to the front of the queue (it was admitted
  before anyone still waiting).
- Priority: by (priority, arrival time), lower first. `running` is kept most urgent first, the
  victim is the least urgent, and a preempted request's key already places it in the queue.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence

from mmserve.core.request import Request


class RequestQueue(ABC):
    """Waiting requests in the order a policy admits them. A request is in the queue at most once:
    `push`/`push_front` take one that is not queued, `remove` one that is (ValueError otherwise)."""

    @abstractmethod
    def push(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def push_front(self, request: Request) -> None:
        """Queue a preempted request again, ahead of those its policy says it precedes."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to admit next (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Take the request `peek` returns."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take a request out from anywhere in the queue (aborted, or admitted out of turn)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0

    @abstractmethod
    def add_running(self, running: list[Request], request: Request) -> None:
        """Insert an admitted request into `running`, which the scheduler serves front to back."""

    @abstractmethod
    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt among `candidates` (a non-empty slice of `running`)."""


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)  # O(position): admitted out of turn or aborted is near the front

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def add_running(self, running: list[Request], request: Request) -> None:
        running.append(request)

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        return candidates[-1]  # the most recently admitted


def urgency(request: Request) -> tuple[int, float]:
    """The priority policy's sort key: lower runs first (priority, then arrival)."""
    return request.priority, request.arrival_time


class PriorityRequestQueue(RequestQueue):
    """A binary heap with lazy deletion: `remove` only forgets the request's entry number, and
    entries no longer live are dropped when they reach the top (or when they outnumber the live
    ones, so the heap stays within twice the queue's length). Every operation is O(log n)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []  # (priority, arrival, entry, request)
        self._live: dict[str, int] = {}  # request id → its live entry number
        self._entry_numbers = itertools.count()  # ties keep push order; entries never compare requests

    def push(self, request: Request) -> None:
        if request.request_id in self._live:
            raise ValueError(f"{request.request_id} is already queued")
        entry = next(self._entry_numbers)
        self._live[request.request_id] = entry
        heapq.heappush(self._heap, (*urgency(request), entry, request))

    def push_front(self, request: Request) -> None:
        self.push(request)  # its (priority, arrival) places it

    def peek(self) -> Request:
        self._drop_dead_top()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_dead_top()
        request = heapq.heappop(self._heap)[3]
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        if self._live.pop(request.request_id, None) is None:
            raise ValueError(f"{request.request_id} is not queued")
        if len(self._heap) > 2 * len(self._live) + 8:
            self._heap = [e for e in self._heap if self._is_live(e)]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter([e[3] for e in sorted(e for e in self._heap if self._is_live(e))])

    def add_running(self, running: list[Request], request: Request) -> None:
        # Most urgent first: served first, and the least urgent are found at the back.
        bisect.insort(running, request, key=urgency)

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=urgency)

    def _is_live(self, entry: tuple[int, float, int, Request]) -> bool:
        return self._live.get(entry[3].request_id) == entry[2]

    def _drop_dead_top(self) -> None:
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)
        if not self._heap:
            raise IndexError("the queue is empty")


_POLICIES: dict[str, type[RequestQueue]] = {"fcfs": FCFSRequestQueue, "priority": PriorityRequestQueue}


def create_request_queue(policy: str) -> RequestQueue:
    """An empty queue for a scheduling policy: "fcfs" or "priority"."""
    try:
        return _POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {sorted(_POLICIES)}") from None
