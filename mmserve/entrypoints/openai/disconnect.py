"""Abandon a non-streaming response when its client goes away, so its engine requests are
aborted at once instead of running to the end for no one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from mmserve.entrypoints.openai.errors import OpenAIError
from mmserve.entrypoints.openai.generation import client_error

Result = TypeVar("Result")


async def until_disconnected(raw: Request, work: Awaitable[Result]) -> Result:
    """Await `work`, but cancel it (aborting its requests) and raise a 499 if the client
    disconnects first; a failure of `work` becomes the HTTP error a client should see."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            try:
                return task.result()
            except Exception as e:  # e.g. EngineCore died mid-request: 503, not a bare 500
                raise client_error(e) from None
        raise OpenAIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler was cancelled (shutdown)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
