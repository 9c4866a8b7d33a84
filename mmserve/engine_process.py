"""The EngineCore process: a busy loop around an EngineCore, fed and drained over ZeroMQ."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from mmserve import envs, protocol
from mmserve.config import EngineConfig
from mmserve.core.sched_output import ExecutorDeadError
from mmserve.process_name import set_process_name

if TYPE_CHECKING:
    from mmserve.core.engine_core import EngineCore

logger = logging.getLogger("mmserve.engine_core")


def run_engine_core_process(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int
) -> None:
    """Body of the EngineCore process: build the engine, then loop — drain requests and aborts
    without waiting, step, send outputs — until told to stop or orphaned.

    Never blocks on the frontend: it sleeps on its input socket only while it has no work.
    """
    start = time.perf_counter()
    set_process_name("mmserve-engine")
    # A spawned child starts with no logging set up; the server's level comes through the
    # environment (the CLI exports MMSERVE_LOG_LEVEL), so progress lines reach the same stream.
    logging.basicConfig(
        level=envs.log_level().upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Imported here, in the child: the API server process never loads the model code.
    from mmserve.engine import build_engine_core

    stop = False

    def request_stop(*_args) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when we stop
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_address)
    try:
        engine_core = build_engine_core(config)
    except Exception as e:  # report why we could not start instead of dying silently
        logger.exception("EngineCore failed to start")
        outbox.send_multipart([protocol.FAILED, f"{type(e).__name__}: {e}".encode()])
        outbox.close(linger=2000)
        return
    outbox.send_multipart(protocol.encode_ready(_ready(engine_core, time.perf_counter() - start)))
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    dead = False
    idle = False  # the last step ran nothing and had nothing to tell: its requests all wait
    try:
        while not stop:
            if os.getppid() != parent_pid:
                logger.error("the API server process is gone; EngineCore exits")
                break
            # While every request waits (for a grammar to compile), wait 1 ms for news between
            # steps rather than spin, and send nothing.
            timeout_ms = (1 if idle else 0) if engine_core.has_work() else 200
            if poller.poll(timeout_ms):
                _drain_inbox(inbox, engine_core)
            elif timeout_ms == 200:
                engine_core.check_health()  # idle: a dead worker would otherwise go unnoticed
            if engine_core.has_work():
                outputs = engine_core.step()
                news = outputs.outputs or outputs.released_pixel_handles or outputs.unreadable_pixels
                idle = engine_core.last_step_tokens == 0 and not news
                if not idle:
                    outbox.send_multipart(protocol.encode_outputs(outputs), copy=False)
    except ExecutorDeadError:
        logger.exception("a worker is gone; EngineCore exits")
        dead = True
    finally:
        engine_core.shutdown()
        inbox.close(linger=0)
        outbox.close(linger=0 if dead else 1000)
        ctx.term()
    if dead:
        # The frontend reports the engine dead when this process ends: end it now, without the
        # interpreter's teardown (seconds on a loaded machine); everything it held is released.
        sys.stderr.flush()
        os._exit(1)


def _ready(engine_core: EngineCore, load_time_s: float) -> protocol.EngineReady:
    info = engine_core.executor.collective_rpc("startup_info")[0]  # rank 0's, wherever it runs
    return protocol.EngineReady(
        num_blocks=engine_core.scheduler.kv.pool.num_blocks,
        device=info["device"],
        num_threads=info["num_threads"],
        attention_backend=info["attention_backend"],
        load_time_s=load_time_s,
    )


def _drain_inbox(inbox: zmq.Socket, engine_core: EngineCore) -> None:
    while True:
        try:
            frames = [frame.buffer for frame in inbox.recv_multipart(zmq.NOBLOCK, copy=False)]
        except zmq.Again:
            return
        kind = bytes(frames[0])
        try:
            if kind == protocol.ADD:
                engine_core.add_request(protocol.decode_add(frames))
            elif kind == protocol.ABORT:
                engine_core.abort_requests(protocol.decode_abort(frames))
        except (msgspec.DecodeError, ValueError, IndexError) as e:
            # A malformed message is the sender's bug; drop it rather than the engine.
            logger.error("dropping a malformed %r message: %s", kind, e)
