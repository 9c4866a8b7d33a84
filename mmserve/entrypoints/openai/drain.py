"""Shutting down without cutting anyone off (SIGTERM): the drain's state and its deadline.

When the HTTP server stops accepting (see http_server.DrainingServer), running requests get
`timeout_s` to finish. At the deadline every request still open fails with
`ServerShuttingDown` — a 503, or for a stream an error event followed by `[DONE]` — and new
ones are refused with it, so every client learns how its request ended.
"""

from __future__ import annotations

import asyncio
import logging

from mmserve.frontend.async_llm import AsyncLLM, ServerShuttingDown

logger = logging.getLogger("mmserve.api_server")


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self._engine: AsyncLLM | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def attach(self, engine: AsyncLLM) -> None:
        """The engine whose requests the deadline ends (set once the server has started)."""
        self._engine = engine

    def begin(self) -> None:
        """Called in the event loop when shutdown begins; starts the grace period once."""
        if self.draining:
            return
        self.draining = True
        open_requests = self._engine.num_unfinished if self._engine is not None else 0
        logger.info("shutting down: %d requests open get %g s to finish", open_requests, self.timeout_s)
        self._deadline = asyncio.get_running_loop().call_later(self.timeout_s, self._end_open_requests)

    def _end_open_requests(self) -> None:
        if self._engine is None:
            return
        logger.info("shutdown deadline: ending %d unfinished requests", self._engine.num_unfinished)
        self._engine.fail_open_requests(
            ServerShuttingDown(
                f"the server is shutting down; the request did not finish within {self.timeout_s:g} s"
            )
        )
