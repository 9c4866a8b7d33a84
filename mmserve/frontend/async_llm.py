"""The serving frontend's engine handle: submit a prompt, stream RequestOutputs, abort.

One background task reads EngineCore's outputs, detokenises them (OutputProcessor) and hands
each request its deltas (RequestOutputKind.DELTA) through its own queue, so the API handlers
only await queues. If EngineCore dies, every open request gets EngineDeadError and
`on_engine_dead` is called once. The same task keeps the input processor's mirror of the
engine's encoder cache current, answers the engine's asks for pixels (engine_mirror.py) and
unpins the pixel handles the engine has read (all of them if it dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable

import numpy as np

from mmserve.config import EngineConfig
from mmserve.frontend.core_client import EngineDeadError, MPCoreClient
from mmserve.frontend.engine_mirror import PixelSources
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.media_processor import handle_ids
from mmserve.frontend.output_processor import OutputProcessor
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.outputs import RequestOutput, RequestOutputKind
from mmserve.protocol import EngineCoreOutputs, EngineRequest, PixelHandle, SchedulerStats
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
        on_engine_dead: Callable[[], None] | None = None,
        on_outputs: Callable[[list[RequestOutput], SchedulerStats | None], None] | None = None,
        inputs: InputProcessor | None = None,
    ) -> None:
        """`inputs`: the input processor whose mirror and pool serve the engine's images (None:
        prompts carry every image's pixels, and an ask for pixels fails its request)."""
        self.config = config
        self.client = MPCoreClient(config)
        self.outputs = outputs
        self.inputs = inputs
        self.pixel_sources = PixelSources()
        self._suppliers: set[asyncio.Task] = set()
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
        (client gone, task cancelled) aborts the request in the engine."""
        if self.dead:
            raise EngineDeadError("the engine is not running")
        if self._refusal is not None:
            raise self._refusal
        queue: asyncio.Queue = asyncio.Queue()
        children = self.outputs.add_request(
            request_id, prompt.prompt, prompt.token_ids, params, RequestOutputKind.DELTA
        )
        self._queues[request_id] = queue
        if reservation is not None:
            reservation.take_one()
        finished = False
        engine_ids = [engine_id for engine_id, _ in children]
        try:
            now = time.monotonic()
            try:
                for engine_id, child_params in children:
                    self.pixel_sources.add(engine_id, prompt.sources)
                    await self._send(self._engine_request(prompt, engine_id, child_params, now, priority))
            finally:
                prompt.release_shared()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            self.pixel_sources.forget(engine_ids)
            if not finished:
                await self.abort(request_id)

    def _engine_request(
        self, prompt: ProcessedPrompt, engine_id: str, params: SamplingParams, now: float, priority: int
    ) -> EngineRequest:
        if self.inputs is None:  # no pool to pin in: pixels are copied into the message
            return prompt.engine_request(engine_id, params, now, priority)
        return self.inputs.media.engine_request(prompt, engine_id, params, now, priority)

    async def _send(self, request: EngineRequest) -> None:
        """Send one engine request; the pins of its pixel handles are given back if it does not
        go, or if the engine died meanwhile (it reads nothing more)."""
        try:
            await self.client.add_request(request)
        except BaseException:
            self._release_handles(handle_ids(request))
            raise
        if self.dead:
            self._release_handles(handle_ids(request))

    def _release_handles(self, use_ids: list[int]) -> None:
        if self.inputs is not None:
            self.inputs.media.release_handles(use_ids)

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
                self._handle_images(engine_outputs)
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
            if self.inputs is not None:
                self.inputs.media.pool.unpin_all()  # nothing will read the handles in flight
            for queue in self._queues.values():
                queue.put_nowait(error)
            if self._on_engine_dead is not None:
                self._on_engine_dead()

    def _handle_images(self, engine_outputs: EngineCoreOutputs) -> None:
        self._release_handles(engine_outputs.released_pixel_handles)
        if self.inputs is not None:
            self.inputs.media.mirror.apply(engine_outputs.encoder_cache_changes)
        for request_id, mm_hash in engine_outputs.pixels_needed:
            task = asyncio.create_task(self._supply_pixels(request_id, mm_hash))
            self._suppliers.add(task)
            task.add_done_callback(self._suppliers.discard)

    async def _supply_pixels(self, request_id: str, mm_hash: str) -> None:
        """Send the engine the pixels it asked for (by handle, unless it asked again for them:
        a handle it could not read); a request whose image cannot be had again (its pool
        failed) is aborted rather than left waiting."""
        source = self.pixel_sources.get(request_id, mm_hash)
        if source is None:
            return  # the request has finished or was aborted: the engine drops it
        try:
            if self.inputs is None:
                raise RuntimeError("no input processor to make pixels with")
            media = self.inputs.media
            processed = await media.pixels_async(source, mm_hash)
            try:
                answer = media.answer(processed, self.pixel_sources.first_answer(request_id, mm_hash))
                await self._send_pixels(request_id, mm_hash, answer)
            finally:
                processed.release()
            media.mirror.pixels_resent += 1
        except Exception:
            logger.exception("could not supply the pixels of image %s to request %s", mm_hash, request_id)
            await self.client.abort_requests([request_id])

    async def _send_pixels(self, request_id: str, mm_hash: str, pixels: np.ndarray | PixelHandle) -> None:
        """`_send` for an answer to an ask for pixels."""
        handles = [pixels.use_id] if isinstance(pixels, PixelHandle) else []
        try:
            await self.client.send_pixels(request_id, mm_hash, pixels)
        except BaseException:
            self._release_handles(handles)
            raise
        if self.dead:
            self._release_handles(handles)

    async def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        await asyncio.to_thread(self.client.shutdown)
        if self.inputs is not None:
            self.inputs.media.pool.unpin_all()  # the engine is gone
