"""Admission control: at most `capacity` computations accepted at once, FIFO for the rest.

Blocking callers wait on a `threading.Event`, asyncio callers on a future of their own loop;
both queue in one line, so neither API can starve the other.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

from preprocess.errors import PreprocessPoolClosed


class _Waiter:
    __slots__ = ("error", "granted", "notify")

    def __init__(self, notify: Callable[[], bool]) -> None:
        self.notify = notify
        self.granted = False
        self.error: Exception | None = None


class AdmissionGate:
    """A FIFO counting semaphore usable from threads and from asyncio; `close` fails waiters."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._free = capacity
        self._waiters: deque[_Waiter] = deque()
        self._closed = False
        self._lock = threading.Lock()

    def _try_enter(self, waiter: _Waiter | None) -> bool:
        """Take a slot now if one is free and nobody is ahead; else queue `waiter`. Locked."""
        if self._closed:
            raise PreprocessPoolClosed("the preprocess pool is closed")
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        if waiter is not None:
            self._waiters.append(waiter)
        return False

    def acquire(self) -> None:
        """Block until a slot is ours."""
        event = threading.Event()
        waiter = _Waiter(lambda: event.set() or True)
        with self._lock:
            if self._try_enter(waiter):
                return
        event.wait()
        if waiter.error is not None:
            raise waiter.error

    async def acquire_async(self) -> None:
        """Wait without blocking the loop. If cancelled, the slot is not taken (or given back)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def notify() -> bool:
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))
            except RuntimeError:  # the waiter's loop is closed: nobody will use the slot
                return False
            return True

        waiter = _Waiter(notify)
        with self._lock:
            if self._try_enter(waiter):
                return
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                granted = waiter.granted
                if not granted and waiter in self._waiters:
                    self._waiters.remove(waiter)
            if granted and waiter.error is None:
                self.release()
            raise
        if waiter.error is not None:
            raise waiter.error

    def release(self) -> None:
        """Give a slot back: to the longest waiter if any, else to the free count."""
        with self._lock:
            if self._waiters:
                waiter = self._waiters.popleft()
                waiter.granted = True
            else:
                self._free += 1
                return
        if not waiter.notify():
            self.release()

    def close(self) -> None:
        """Refuse new entries and fail every waiter with `PreprocessPoolClosed`."""
        with self._lock:
            self._closed = True
            waiters = list(self._waiters)
            self._waiters.clear()
        for waiter in waiters:
            waiter.error = PreprocessPoolClosed("the preprocess pool was closed while waiting")
            waiter.granted = True
            waiter.notify()
