"""The waiting queue: first-come-first-served, or by (priority, arrival) when priorities are on.

Preempted requests go back to the front under FCFS (they were admitted before anyone still
waiting); under the priority policy their priority and arrival time already place them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from mmserve.core.request import Request


class RequestQueue:
    def __init__(self, priority_policy: bool = False) -> None:
        self.priority_policy = priority_policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def push(self, request: Request) -> None:
        if self.priority_policy:
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._order), request))
        else:
            self._fifo.append(request)

    def push_front(self, request: Request) -> None:
        if self.priority_policy:
            self.push(request)
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.priority_policy else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.priority_policy else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.priority_policy:
            self._heap = [entry for entry in self._heap if entry[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.priority_policy else len(self._fifo)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self):
        return iter([e[3] for e in sorted(self._heap)] if self.priority_policy else self._fifo)
