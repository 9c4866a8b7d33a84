"""How the frontend reaches EngineCore. In-process here; the serving path adds a ZeroMQ client
with the same methods."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from mmserve import protocol
from mmserve.config import EngineConfig
from mmserve.engine_process import run_engine_core_process
from mmserve.openmp_env import model_process_environment
from mmserve.protocol import EngineCoreOutputs, EngineRequest

if TYPE_CHECKING:
    from mmserve.core.engine_core import EngineCore

logger = logging.getLogger("mmserve.frontend")


class InprocCoreClient:
    """EngineCore in the caller's process: each `get_output` runs one engine step."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core

    def add_request(self, request: EngineRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.engine_core.abort_requests(list(request_ids))

    def has_work(self) -> bool:
        return self.engine_core.has_work()

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()


class EngineDeadError(RuntimeError):
    """EngineCore stopped; nothing more will come from it."""


class MPCoreClient:
    """EngineCore in its own process, reached over ZeroMQ (ipc:// sockets in a private dir).

    The frontend binds both sockets; the engine connects. `start` waits for the engine's READY
    (model loaded, KV cache sized) or its FAILED message, or its death.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="mmserve-ipc-")
        self.input_address = f"ipc://{self._dir}/input"
        self.output_address = f"ipc://{self._dir}/output"
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._to_engine.bind(self.input_address)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._from_engine.bind(self.output_address)
        self.process = None
        self.num_blocks = 0
        self.ready: protocol.EngineReady | None = None  # what the engine reported at READY
        self.dead = False
        self.pixel_bytes_sent = 0  # bytes of pixel arrays sent as frames (not by handle)

    async def start(self, timeout_s: float = 600.0) -> None:
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_core_process,
            args=(self.config, self.input_address, self.output_address, os.getpid()),
            name="mmserve-engine-core",
            daemon=False,
        )
        with model_process_environment():
            self.process.start()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if await self._from_engine.poll(200):
                kind, info = await self._from_engine.recv_multipart()
                if kind == protocol.READY:
                    self.ready = protocol.decode_ready(info)
                    self.num_blocks = self.ready.num_blocks
                    return
                raise RuntimeError(f"EngineCore failed to start: {info.decode()}")
            if not self.process.is_alive():
                raise RuntimeError(f"EngineCore exited during start-up (exit code {self.process.exitcode})")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"EngineCore did not start within {timeout_s:.0f} s")

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    async def add_request(self, request: EngineRequest) -> None:
        """Send a request. Its message is queued before this first awaits (see `_send`), so a
        caller that decided its pixel-store changes in the same event-loop turn sends them in the
        order it decided them (frontend/pixel_store_mirror.py). Raising anything but
        CancelledError or EngineDeadError, it was not queued."""
        frames = protocol.encode_add(request)
        self.pixel_bytes_sent += sum(memoryview(frame).nbytes for frame in frames[2:])
        await self._send(frames, copy=False)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._send(protocol.encode_abort(list(request_ids)))

    async def _send(self, frames: list, copy: bool = True) -> None:
        """Send one message to the engine, or raise EngineDeadError once it has died: a PUSH
        socket whose only peer is gone holds the message, and its sender, until a peer connects,
        which a dead engine never does. A send that cannot go at once (rare: the queue to the
        engine is full) checks the engine's process every 100 ms while it waits. The message is
        queued (`send_multipart`) before the first await, and stays queued, in order, if the
        caller is cancelled while it waits."""
        sending = self._to_engine.send_multipart(frames, copy=copy)
        while not sending.done():
            await asyncio.wait({sending}, timeout=0.1)
            if not sending.done() and not self.is_alive():
                sending.cancel()
                raise EngineDeadError(f"EngineCore died (exit code {self.process.exitcode})")
        sending.result()

    async def get_output(self, poll_ms: int = 100) -> EngineCoreOutputs | None:
        """The next step's outputs, or None if nothing arrived within `poll_ms` (the caller
        checks liveness between polls)."""
        if not await self._from_engine.poll(poll_ms):
            return None
        frames = await self._from_engine.recv_multipart()
        return protocol.decode_outputs(frames)

    def shutdown(self, timeout_s: float = 4.0) -> None:
        """Stop the engine (SIGTERM, then SIGKILL) and remove the sockets."""
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(1.0)
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
