"""The body of one worker process of the multiprocessing executor.

It joins its tensor-parallel rank's group, builds its shard of the model, and then runs what
the executor broadcasts, in order: a step (every rank runs it; rank 0 alone answers with the
sampled tokens) or a method call (every rank answers). A failure is answered with ERROR and ends
the process: the group's collectives cannot continue without it, so the engine is dead.

It never outlives the process that started it: a thread watches the parent and exits the
process when the parent is gone, even while the main thread is blocked in a collective.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
import traceback

from mmserve.config import EngineConfig
from mmserve.distributed import message_queue as mq
from mmserve.distributed.parallel_state import DistributedInit
from mmserve.executor.worker_factory import build_worker
from mmserve.process_name import set_process_name
from mmserve.worker.worker import Worker

logger = logging.getLogger("mmserve.worker")


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process as soon as `parent_pid` is no longer its parent (it died)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_worker_process(
    config: EngineConfig,
    distributed_init: DistributedInit,
    broadcast_address: str,
    result_address: str,
    parent_pid: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    set_process_name(f"mmserve-rank{distributed_init.rank}")
    watch_parent(parent_pid)
    channel = mq.WorkerChannel(broadcast_address, result_address, distributed_init.rank)
    try:
        worker = build_worker(config, distributed_init)
    except Exception as e:
        logger.exception("worker %d failed to start", distributed_init.rank)
        channel.send(mq.FAILED, f"{type(e).__name__}: {e}".encode())
        channel.close()
        raise SystemExit(1) from None
    channel.send(mq.STARTED)
    try:
        serve(worker, channel)
    finally:
        channel.close()


def serve(worker: Worker, channel: mq.WorkerChannel) -> None:
    """Run broadcasts until STOP (returns) or a failure (answers ERROR, exits non-zero)."""
    subscribed = False
    while True:
        kind, payload = channel.receive()
        if kind == mq.HELLO:
            if not subscribed:
                channel.send(mq.SUBSCRIBED)
                subscribed = True
            continue
        if kind == mq.STOP:
            return
        try:
            if kind == mq.STEP:
                output = worker.execute_model(pickle.loads(payload))
                if worker.rank == 0:
                    channel.send(mq.OUTPUT, pickle.dumps(output, protocol=5))
            elif kind == mq.RPC:
                method, args = pickle.loads(payload)
                channel.send(mq.REPLY, pickle.dumps(getattr(worker, method)(*args), protocol=5))
        except Exception:
            logger.exception("worker %d failed", worker.rank)
            channel.send(mq.ERROR, traceback.format_exc(limit=8).encode())
            raise SystemExit(1) from None
