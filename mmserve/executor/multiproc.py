"""One worker process per tensor-parallel rank on this machine, none of them the EngineCore's.

Each step the scheduler output (new requests in full, then only diffs) is pickled once and
published once to every worker (`message_queue`); rank 0 alone answers with the sampled tokens.
While it waits, the executor watches every worker process: one that died, or answered with an
error, makes the executor dead within a poll interval (`ExecutorDeadError`), and `shutdown`
stops the others (they may be blocked in a collective with the dead one) and removes the sockets.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from typing import Any

from mmserve.config import EngineConfig
from mmserve.core.sched_output import ExecutorDeadError, ModelRunnerOutput, SchedulerOutput
from mmserve.distributed import message_queue as mq
from mmserve.distributed.parallel_state import DistributedInit, host_store
from mmserve.executor.abstract import Executor
from mmserve.executor.worker_factory import distributed_backend
from mmserve.executor.worker_process import run_worker_process
from mmserve.openmp_env import model_process_environment

logger = logging.getLogger("mmserve.executor")

POLL_MS = 100  # how often a wait checks that every worker is alive
START_TIMEOUT_S = 600.0


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.world_size = config.parallel.world_size
        self._dir = tempfile.mkdtemp(prefix="mmserve-workers-")
        self.channel = mq.ExecutorChannel(self._dir)
        self._store = host_store("127.0.0.1")
        backend = distributed_backend(config)
        context = multiprocessing.get_context("spawn")
        self.processes = [
            context.Process(
                target=run_worker_process,
                args=(
                    config,
                    DistributedInit("127.0.0.1", self._store.port, rank, self.world_size, backend),
                    self.channel.broadcast_address,
                    self.channel.result_address,
                    os.getpid(),
                ),
                name=f"mmserve-worker-{rank}",
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        self._closed = False
        try:
            with model_process_environment():
                for process in self.processes:
                    process.start()
            self._wait_started()
            self.channel.wait_subscribed(self.world_size, self._check_alive, START_TIMEOUT_S)
            self.num_blocks = min(self.collective_rpc("determine_num_blocks"))
            self.collective_rpc("initialize_kv_cache", self.num_blocks)
        except BaseException:
            self.shutdown()
            raise

    def _wait_started(self) -> None:
        started: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(started) < self.world_size:
            rank, kind, payload = self._receive(deadline)
            if kind == mq.FAILED:
                raise RuntimeError(f"worker {rank} failed to start: {payload.decode()}")
            started.add(rank)

    def check_health(self) -> None:
        if not self._closed:
            self._check_alive()

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
                raise ExecutorDeadError(
                    f"worker {rank} (pid {process.pid}) died, exit code {process.exitcode}"
                )

    def _blame_a_dead_rank(self, grace_s: float = 1.0) -> None:
        """A rank that died is the cause of its peers' errors: raise for it if one has died. Its
        peers can see its sockets reset a moment before its exit is visible here, so look for
        `grace_s` (the engine is dead either way: this only chooses what the error names)."""
        deadline = time.monotonic() + grace_s
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def _receive(self, deadline: float = float("inf")) -> mq.Message:
        """The next worker message; raises if a worker died or answered with an error first."""
        while True:
            message = self.channel.receive(POLL_MS)
            if message is not None:
                rank, kind, payload = message
                if kind == mq.ERROR:
                    self._blame_a_dead_rank()
                    raise ExecutorDeadError(f"worker {rank} failed:\n{payload.decode()}")
                return message
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not answer in time")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._closed:
            raise ExecutorDeadError("the executor is shut down")
        self.last_step_bytes = self.channel.publish(mq.STEP, pickle.dumps(scheduler_output, protocol=5))
        self.total_step_bytes += self.last_step_bytes
        rank, kind, payload = self._receive()
        if (rank, kind) != (0, mq.OUTPUT):
            raise ExecutorDeadError(f"worker {rank} sent {kind!r} where rank 0's step output was due")
        return pickle.loads(payload)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._closed:
            raise ExecutorDeadError("the executor is shut down")
        self.channel.publish(mq.RPC, pickle.dumps((method, args), protocol=5))
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            rank, kind, payload = self._receive()
            if kind != mq.REPLY:
                raise ExecutorDeadError(f"worker {rank} sent {kind!r} where a reply to {method} was due")
            results[rank] = pickle.loads(payload)
        return [results[rank] for rank in range(self.world_size)]

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Ask the workers to stop, then terminate (and kill) any still running; remove the sockets."""
        if self._closed:
            return
        self._closed = True
        if all(p.is_alive() for p in self.processes):  # healthy: let them return from their loop
            self.channel.publish(mq.STOP)
            deadline = time.monotonic() + timeout_s
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        # the others may be blocked in a collective with a dead rank: stop them now
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        self.channel.close()
        self._store = None
        shutil.rmtree(self._dir, ignore_errors=True)
