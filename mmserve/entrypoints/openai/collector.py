"""Python's cyclic garbage collector, kept from stopping the event loop.

A full (oldest-generation) collection walks every tracked object and holds the GIL throughout.
In the API server it ran whenever long-lived objects had grown by a quarter — every few
thousand allocations of a request with many log-probabilities — and each pass over ~10^5
objects stopped every request and /health for 0.15-0.4 s on a busy machine. So:

* the start-up heap (torch, the tokenizer, the app: ~10^6 objects that live as long as the
  process) is frozen, out of every collection's sight;
* the oldest generation is never collected automatically; the young ones still are (their
  cost is bounded by their size, thousands of objects), and reference counting frees all
  garbage that is not a cycle, which is nearly all of a request's;
* a full collection runs once the server has been idle (no HTTP request being served, none in
  the engine: a large answer is still being built after its engine request finished) for
  `IDLE_S` after work, and at the latest every `MAX_INTERVAL_S`, so cycles that reached the
  oldest generation do not pile up.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger("mmserve.api_server")

IDLE_S = 2.0
MAX_INTERVAL_S = 60.0
_NEVER = 1 << 30  # a threshold for the oldest generation that is never reached


class Collector:
    def __init__(self, busy: Callable[[], bool]) -> None:
        self._busy = busy
        self._task: asyncio.Task | None = None
        self._thresholds = gc.get_threshold()

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        young, middle, _ = self._thresholds
        gc.set_threshold(young, middle, _NEVER)
        self._task = asyncio.create_task(self._collect_when_idle(), name="mmserve-gc")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        gc.set_threshold(*self._thresholds)
        gc.unfreeze()

    async def _collect_when_idle(self) -> None:
        last = idle_since = time.monotonic()
        worked = False  # since the last collection
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            if self._busy():
                idle_since, worked = now, True
            if (worked and now - idle_since >= IDLE_S) or now - last >= MAX_INTERVAL_S:
                started = time.perf_counter()
                found = gc.collect()
                logger.debug(
                    "full collection: %d objects freed in %.3f s", found, time.perf_counter() - started
                )
                last, worked = time.monotonic(), False
