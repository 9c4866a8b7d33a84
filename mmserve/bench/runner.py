"""Drive a workload against a server: arrivals, a concurrency cap, warm-ups and a progress bar.

Arrivals follow vLLM: gaps are gamma-distributed with shape `burstiness` and mean 1/rate
(burstiness 1 = Poisson; < 1 burstier; > 1 more regular); rate inf sends everything at once.
`max_concurrency` caps requests in flight (single-turn) or conversations in flight (multi-turn,
where one conversation is one chat-UI user waiting for each answer before the next turn).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from mmserve.bench.client import Endpoint, chat_body, send_chat, upload_image
from mmserve.bench.metrics import RequestResult
from mmserve.bench.workload import Conversation, SingleTurn


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = float("inf")  # requests (or conversations) per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    output_len: int = 128
    ignore_eos: bool = False
    seed: int = 0
    video_options: dict | None = None  # mm_processor_kwargs of requests with a video
    image_refs: str = "data-url"  # multi-turn: "file" uploads each image once, then sends its id


def arrival_offsets_s(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request relative to the first (which goes at 0)."""
    if rate == float("inf"):
        return np.zeros(num)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if num else gaps


class Progress:
    """tqdm when installed, else a line on stderr every 10%."""

    def __init__(self, total: int, disable: bool = False) -> None:
        self.total, self.done, self.disable = total, 0, disable
        try:
            from tqdm import tqdm

            self._bar = None if disable else tqdm(total=total, file=sys.stderr)
        except ImportError:
            self._bar = None

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif not self.disable and (self.done == self.total or self.done % max(1, self.total // 10) == 0):
            print(f"  {self.done}/{self.total} requests", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _paced(
    jobs: list[Callable[[], Awaitable[list[RequestResult]]]], shape: LoadShape
) -> tuple[list[RequestResult], float]:
    """Start job i at its arrival offset, at most `max_concurrency` at once; (results, duration)."""
    offsets = arrival_offsets_s(len(jobs), shape.request_rate, shape.burstiness, shape.seed)
    limit = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    t0 = time.perf_counter()

    async def one(job, offset: float) -> list[RequestResult]:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        if limit is None:
            return await job()
        async with limit:
            return await job()

    grouped = await asyncio.gather(*(one(job, off) for job, off in zip(jobs, offsets)))
    return [r for group in grouped for r in group], time.perf_counter() - t0


def _unpaced(shape: LoadShape) -> LoadShape:
    return dataclasses.replace(shape, request_rate=float("inf"))


def _client(shape: LoadShape) -> httpx.AsyncClient:
    connections = max(shape.max_concurrency or 0, 256)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=connections))


async def run_single_turn(
    endpoint: Endpoint,
    requests: list[SingleTurn],
    shape: LoadShape,
    warmups: Sequence[SingleTurn] = (),
    quiet: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send the `warmups` (untimed, all at once under the concurrency cap), then the requests."""
    async with _client(shape) as client:

        def job(req: SingleTurn, progress: Progress | None):
            async def run() -> list[RequestResult]:
                body = chat_body(endpoint.model, [req.message()], shape.output_len, shape.ignore_eos)
                if req.video_url and shape.video_options:
                    body["mm_processor_kwargs"] = shape.video_options
                result = await send_chat(client, endpoint, body)
                if progress is not None:
                    progress.update()
                return [result]

            return run

        if warmups:
            await _paced([job(r, None) for r in warmups], _unpaced(shape))
        progress = Progress(len(requests), disable=quiet)
        try:
            return await _paced([job(r, progress) for r in requests], shape)
        finally:
            progress.close()


async def run_multi_turn(
    endpoint: Endpoint,
    conversations: list[Conversation],
    shape: LoadShape,
    warmups: Sequence[SingleTurn] = (),
    quiet: bool = False,
) -> tuple[list[RequestResult], float]:
    """Send the `warmups`, then play each conversation turn by turn: every turn waits for the
    previous answer and resends the whole history, every earlier image included (as a data URL,
    or with `shape.image_refs == "file"` as the id of a file uploaded when the conversation
    starts, untimed). A failed turn ends its conversation."""
    if warmups:
        await run_single_turn(endpoint, list(warmups), _unpaced(shape), quiet=True)
    async with _client(shape) as client:
        progress = Progress(sum(len(c.user_texts) for c in conversations), disable=quiet)

        def job(conv: Conversation):
            async def run() -> list[RequestResult]:
                history: list[dict] = []
                results = []
                file_ids = None
                if shape.image_refs == "file":
                    try:
                        file_ids = [await upload_image(client, endpoint, url) for url in conv.image_urls]
                    except httpx.HTTPError as e:
                        return [RequestResult(success=False, error=f"image upload failed: {e}")]
                for turn in range(len(conv.user_texts)):
                    history.append(conv.message(turn, file_ids))
                    body = chat_body(endpoint.model, history, shape.output_len, shape.ignore_eos)
                    if conv.video_urls and shape.video_options:
                        body["mm_processor_kwargs"] = shape.video_options
                    result = await send_chat(client, endpoint, body, turn=turn)
                    results.append(result)
                    progress.update()
                    if not result.success:
                        break
                    history.append({"role": "assistant", "content": result.generated_text})
                return results

            return run

        try:
            return await _paced([job(c) for c in conversations], shape)
        finally:
            progress.close()
