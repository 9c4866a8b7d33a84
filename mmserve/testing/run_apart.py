"""Run a coroutine to completion from a test, whatever the calling thread holds."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

Result = TypeVar("Result")


def run_apart(coroutine: Coroutine[Any, Any, Result]) -> Result:
    """asyncio.run in a thread of its own: a browser test earlier in the session (Playwright's
    sync API) leaves an event loop running in the main thread, where asyncio.run refuses."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
