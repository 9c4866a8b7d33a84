"""The serving frontend's engine handle: submit a prompt, stream RequestOutputs, abort.

One background task reads EngineCore's outputs, detokenises them (OutputProcessor) and hands
each request its deltas (RequestOutputKind.DELTA) through its own queue, so the API handlers
only await queues. If EngineCore dies, every open request gets EngineDeadError and
`on_engine_dead` is called once. The same task applies what the engine reports about images
(`MediaProcessor.apply_engine_outputs`: handles it has read are unpinned, items it could not
read leave the mirror of its pixel store), and `engine_gone` if it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable

from mmserve.config import EngineConfig
from mmserve.frontend.core_client import EngineDeadError, MPCoreClient
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.media_processor import handle_ids
from mmserve.frontend.output_processor import OutputProcessor
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.outputs import RequestOutput, RequestOutputKind
from mmserve.protocol import SchedulerStats
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger("mmserve.frontend")


class ServerShuttingDown(RuntimeError):
    """The server is stopping and this request did not finish in the time it was given."""


class Reservation:
    """Places counted in `AsyncLLM.num_unfinished` for requests still being built (images,
    tokens), so a burst cannot slip past a capacity check in the gap before the engine knows
    them. Each `generate` given the reservation takes one place over; `release` (or garbage
    collection, if the request is dropped unstarted) frees the places not taken."""

    def __init__(self, engine: AsyncLLM, places: int) -> None:
        self._left = [places]
        engine._reserved += places
        self._engine = engine
        self._finalizer = weakref.finalize(self, _give_back, engine, self._left)

    def take_one(self) -> None:
        if self._left[0]:
            self._left[0] -= 1
            self._engine._reserved -= 1

    def release(self) -> None:
        self._finalizer()


def _give_back(engine: AsyncLLM, left: list[int]) -> None:
    engine._reserved -= left[0]
    left[0] = 0


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        outputs: OutputProcessor,
        *,
        inputs: InputProcessor,
        on_engine_dead: Callable[[], None] | None = None,
        on_outputs: Callable[[list[RequestOutput], SchedulerStats | None], None] | None = None,
    ) -> None:
        """`inputs`: the input processor that builds the prompts, whose media processor decides
        what the engine's pixel store holds."""
        self.config = config
        self.client = MPCoreClient(config)
        self.outputs = outputs
        self.inputs = inputs
        self.media = inputs.media
        self._queues: dict[str, asyncio.Queue] = {}
        self._on_engine_dead = on_engine_dead
        self._on_outputs = on_outputs
        self._reader: asyncio.Task | None = None
        self.latest_stats = SchedulerStats()
        self.dead = False
        self._reserved = 0
        self._refusal: Exception | None = None  # set when the server stops: fails new requests

    async def start(self) -> None:
        await self.client.start()
        self._reader = asyncio.create_task(self._read_outputs(), name="mmserve-output-reader")

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not finished, plus places reserved for requests being built."""
        return len(self._queues) + self._reserved

    def reserve(self, places: int) -> Reservation:
        return Reservation(self, places)

    async def generate(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        reservation: Reservation | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of the request as it progresses (what is new for each choice; see
        RequestOutputKind.DELTA); the last one has `finished` set. Leaving the iteration early
        (client gone, task cancelled) aborts the request in the engine. The prompt is released
        once sent (or refused)."""
        if self.dead or self._refusal is not None:
            prompt.release()
            raise EngineDeadError("the engine is not running") if self.dead else self._refusal
        queue: asyncio.Queue = asyncio.Queue()
        children = self.outputs.add_request(
            request_id, prompt.prompt, prompt.token_ids, params, RequestOutputKind.DELTA
        )
        self._queues[request_id] = queue
        if reservation is not None:
            reservation.take_one()
        finished = False
        try:
            now = time.monotonic()
            try:
                for engine_id, child_params in children:  # n > 1: the first brings the pixels
                    await self._send(prompt, engine_id, child_params, now, priority)
            finally:
                prompt.release()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def _send(
        self, prompt: ProcessedPrompt, engine_id: str, params: SamplingParams, now: float, priority: int
    ) -> None:
        """Make one engine request and send it. Its pixel-store changes are decided and its
        message queued in one event-loop turn (nothing here awaits in between, and the client
        queues before it first awaits), so messages reach the engine in the order of the
        mirror's decisions. A request that was not queued is undone; the pins of one sent
        after the engine died are given back (nothing reads them)."""
        request = self.media.engine_request(prompt, engine_id, params, now, priority)
        try:
            await self.client.add_request(request)
        except (asyncio.CancelledError, EngineDeadError):
            raise  # queued (it goes when there is room), or the engine is gone (all reset)
        except BaseException:
            self.media.not_sent(request)
            raise
        if self.dead:
            self.media.release_handles(handle_ids(request))

    def fail_open_requests(self, error: Exception) -> None:
        """End every open request with `error` and refuse new ones with it (the server is
        stopping); each request's engine work is aborted as its generator unwinds."""
        self._refusal = error
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def abort(self, request_id: str) -> None:
        engine_ids = self.outputs.abort(request_id)
        if engine_ids and not self.dead:
            await self.client.abort_requests(engine_ids)

    async def _read_outputs(self) -> None:
        try:
            while True:
                engine_outputs = await self.client.get_output()
                if engine_outputs is None:
                    if not self.client.is_alive():
                        raise EngineDeadError(f"EngineCore died (exit code {self.client.process.exitcode})")
                    continue
                self.media.apply_engine_outputs(engine_outputs)
                deltas, to_abort = self.outputs.process_outputs(engine_outputs.outputs)
                if to_abort:
                    await self.client.abort_requests(to_abort)
                if engine_outputs.stats is not None:
                    self.latest_stats = engine_outputs.stats
                for delta in deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
                if self._on_outputs is not None:
                    self._on_outputs(deltas, engine_outputs.stats)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = (
                e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine output loop failed: {e}")
            )
            logger.error("%s; failing %d open requests", error, len(self._queues))
            self.dead = True
            self.media.engine_gone()  # nothing will read the handles in flight
            for queue in self._queues.values():
                queue.put_nowait(error)
            if self._on_engine_dead is not None:
                self._on_engine_dead()

    async def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        await asyncio.to_thread(self.client.shutdown)
        self.media.engine_gone()
