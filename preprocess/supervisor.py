"""Worker processes and the thread that feeds them.

One supervisor thread in the pool process owns every worker pipe: it hands each ready worker
one task at a time, reads results, and watches process sentinels. A worker that exits is
replaced, and the task it held goes to the front of the queue for the next worker: a worker
killed from outside (OOM killer, an operator) must not cost an innocent request. A task whose
second worker dies too completes with `PreprocessWorkerDied` naming the worker, its pid and
exit status: that image is likely what kills them. Every submitted task completes through
`on_done` exactly once, even at close; for a failed task, `on_done` also owns the clean-up of
the task's segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from preprocess import shm
from preprocess.errors import PreprocessError, PreprocessFailed, PreprocessPoolClosed, PreprocessWorkerDied
from preprocess.transform import ImageTransform
from preprocess.worker import Task, TaskDone, WorkerReady, run_task, worker_main

logger = logging.getLogger("preprocess")

OnDone = Callable[[Task, TaskDone], None]
_MAX_ATTEMPTS = 2  # workers a task may outlive: one retry
_MAX_STARTUP_FAILURES = 3  # consecutive workers dying before they are ready: stop respawning
_SHUTDOWN_GRACE_S = 2.0


class InlineExecutor:
    """`num_workers=0`: run each task in the caller's thread (for debugging and tests)."""

    def __init__(self, settings: ImageTransform, on_done: OnDone) -> None:
        self._settings = settings
        self._on_done = on_done
        self.tasks_dispatched = 0
        self.restarts = 0

    def worker_pids(self) -> list[int]:
        return []

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return True

    def submit(self, task: Task) -> None:
        self.tasks_dispatched += 1
        self._on_done(task, run_task(task, self._settings))

    def close(self) -> None:
        """Nothing runs in the background."""


@dataclass
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    ready: bool = False
    task: Task | None = None


class WorkerSupervisor:
    """`num_workers` spawned processes fed one task at a time (no fork: the pool process may
    hold torch and threads)."""

    def __init__(self, settings: ImageTransform, num_workers: int, on_done: OnDone) -> None:
        self._ctx = mp.get_context("spawn")
        self._settings = settings
        self._on_done = on_done
        self._queue: deque[Task] = deque()
        self._lock = threading.Lock()
        self._closing = False
        self._broken: PreprocessError | None = None  # set when workers cannot start; new tasks fail
        self._startup_failures = 0
        self.tasks_dispatched = 0
        self.restarts = 0
        self._all_ready = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers = [self._spawn(index) for index in range(num_workers)]
        self._thread = threading.Thread(target=self._run, name="preprocess-supervisor", daemon=True)
        self._thread.start()

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until every worker has started (and been replaced, if one died)."""
        return self._all_ready.wait(timeout_s)

    def submit(self, task: Task) -> None:
        with self._lock:
            if self._closing:
                raise PreprocessPoolClosed("the preprocess pool is closed")
            broken = self._broken
            if broken is None:
                self._queue.append(task)
        if broken is not None:
            self._on_done(task, TaskDone(task.task_id, error=broken))
            return
        self._wake()

    def close(self) -> None:
        """Stop the workers (grace period, then SIGKILL); unfinished tasks fail as closed."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already holds wake-ups
            os.write(self._wake_w, b"\0")

    def _spawn(self, index: int) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(child_conn, self._settings),
            name=f"mmserve-preprocess-{index}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return _Worker(index, process, parent_conn)

    def _run(self) -> None:
        error: PreprocessError = PreprocessPoolClosed(
            "the preprocess pool was closed before this image was processed"
        )
        try:
            while not self._closing:
                self._step()
        except Exception as exc:  # a bug here must fail the requests, never leave them hanging
            error = PreprocessFailed(f"the preprocess supervisor crashed: {type(exc).__name__}: {exc}")
            with self._lock:
                self._broken = error
            raise
        finally:
            self._shutdown(error)

    def _step(self) -> None:
        self._dispatch()
        conns = [w.conn for w in self._workers]
        sentinels = [w.process.sentinel for w in self._workers]
        ready = set(wait([self._wake_r, *conns, *sentinels]))
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        for worker in list(self._workers):
            if worker.conn in ready:
                self._receive(worker)
        for worker in list(self._workers):
            if worker.process.sentinel in ready:
                self._replace(worker)

    def _dispatch(self) -> None:
        for worker in self._workers:
            if not worker.ready or worker.task is not None:
                continue
            with self._lock:
                if not self._queue:
                    return
                task = self._queue.popleft()
            try:
                worker.conn.send(task)
            except OSError:  # the worker just died; its sentinel will fire
                with self._lock:
                    self._queue.appendleft(task)
                continue
            worker.task = task
            self.tasks_dispatched += 1

    def _receive(self, worker: _Worker) -> None:
        while True:
            try:
                if not worker.conn.poll():
                    return
                message = worker.conn.recv()
            except (EOFError, OSError):
                return  # the worker died; its sentinel handles the rest
            if isinstance(message, WorkerReady):
                worker.ready = True
                self._startup_failures = 0
                if all(w.ready for w in self._workers):
                    self._all_ready.set()
            elif worker.task is not None:
                task, worker.task = worker.task, None
                self._on_done(task, message)

    def _replace(self, worker: _Worker) -> None:
        self._all_ready.clear()
        worker.process.join()
        self._receive(worker)  # a result sent just before exiting still counts
        worker.conn.close()
        status = _describe_exit(worker.process.exitcode)
        if worker.task is not None:
            task, worker.task = worker.task, None
            died = (
                f"preprocess worker {worker.index} (pid {worker.process.pid}) died with {status} "
                f"while processing image {task.mm_hash}"
            )
            if task.attempt + 1 < _MAX_ATTEMPTS:
                logger.warning("%s; retrying it on a new worker", died)
                self._retry(task)
            else:
                error = PreprocessWorkerDied(f"{died} (its second try: it was retried once)")
                self._on_done(task, TaskDone(task.task_id, error=error))
        if not worker.ready:
            self._startup_failures += 1
        if self._startup_failures >= _MAX_STARTUP_FAILURES:
            self._workers.remove(worker)
            self._fail_queued(
                PreprocessWorkerDied(
                    f"preprocess workers keep dying at start-up (the last one exited with {status})"
                )
            )
            return
        self.restarts += 1
        self._workers[self._workers.index(worker)] = self._spawn(worker.index)

    def _retry(self, task: Task) -> None:
        """Queue `task` first again. A segment the dead worker created may be half made: it is
        unlinked and made anew; a recycled one is simply written again."""
        if not task.recycled:
            shm.unlink(task.shm_name)
        with self._lock:
            self._queue.appendleft(dataclasses.replace(task, attempt=task.attempt + 1))

    def _fail_queued(self, error: PreprocessError) -> None:
        with self._lock:
            self._broken = error
            tasks = list(self._queue)
            self._queue.clear()
        for task in tasks:
            self._on_done(task, TaskDone(task.task_id, error=error))

    def _shutdown(self, error: PreprocessError) -> None:
        """Stop every worker; fail what is unfinished with `error`."""
        for worker in self._workers:
            with contextlib.suppress(OSError):  # already dead
                worker.conn.send(None)
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        with self._lock:
            unfinished = [w.task for w in self._workers if w.task is not None] + list(self._queue)
            self._queue.clear()
        for task in unfinished:
            self._on_done(task, TaskDone(task.task_id, error=error))


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"exit code {exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    return f"exit code {exitcode}"
