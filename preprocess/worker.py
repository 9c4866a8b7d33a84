"""One preprocessing step (`run_task`) and the worker process loop around it.

The loop is deliberately dumb: receive a `Task`, run it, send a `TaskDone`. Scheduling,
retries and death handling live in the supervisor, in the pool process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from preprocess import patchify, resample, shm
from preprocess.decode import ImageSource, decode_rgb
from preprocess.errors import ImageError, PreprocessFailed
from preprocess.hashing import pixels_digest
from preprocess.transform import GridTHW, ImageTransform
from preprocess.video import VideoInfo, VideoSource, process_video


@dataclass(frozen=True)
class Task:
    """Process `source` into the segment `shm_name`: a spare of `segment_bytes` if `recycled`,
    else a new one of that size. The pool chooses the segment, so it can clean it up even if
    the worker dies half-way. `attempt` counts the workers that died holding it before."""

    task_id: int
    mm_hash: str
    source: ImageSource | VideoSource
    shm_name: str
    segment_bytes: int
    recycled: bool
    attempt: int = 0


@dataclass(frozen=True)
class TaskDone:
    """Exactly one of (`handle`, `grid`, `digest`) or `error` is set; `video_info` for a video.
    `digest` is `hashing.pixels_digest` of the pixels written."""

    task_id: int
    handle: shm.ShmHandle | None = None
    grid: GridTHW | None = None
    error: Exception | None = None
    video_info: VideoInfo | None = None
    digest: int = 0


@dataclass(frozen=True)
class WorkerReady:
    pid: int


class ScratchPixels(threading.local):
    """This thread's reusable buffer for a task's pixels before they go to shared memory.

    Written in warm memory and then copied into the segment with one `pwrite`: cheaper than
    writing a fresh segment's pages through a mapping (see `shm.write_segment`). Arrays over
    `max_kept_bytes` (long videos) get memory of their own, not kept."""

    max_kept_bytes = 64 << 20

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if nbytes > self.max_kept_bytes:
            return np.empty(shape, dtype=dtype)
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes].view(dtype).reshape(shape)


_scratch = ScratchPixels()


def run_task(task: Task, settings: ImageTransform) -> TaskDone:
    """Decode, transform and write into shared memory. Never raises for a bad image or an
    internal failure: both come back as `TaskDone.error`, and a segment this call created is
    unlinked again (a recycled one stays the pool's)."""
    handle: shm.ShmHandle | None = None
    pixels: np.ndarray | None = None

    def allocate(shape: tuple[int, int]) -> np.ndarray:
        nonlocal handle, pixels
        handle = shm.ShmHandle(task.shm_name, shape)
        pixels = _scratch.array(shape, np.dtype(handle.dtype))
        return pixels

    video_info = None
    try:
        if isinstance(task.source, VideoSource):
            grid, video_info = process_video(task.source, allocate)
        else:
            grid = settings.process(decode_rgb(task.source, settings), allocate)
        assert handle is not None and pixels is not None  # every path allocates its output
        digest = pixels_digest(pixels)
        shm.write_segment(handle, task.segment_bytes, pixels, create=not task.recycled)
    except Exception as exc:
        if handle is not None and not task.recycled:
            shm.unlink(handle.shm_name)  # if write_segment got as far as creating it
        if not isinstance(exc, ImageError):
            exc = PreprocessFailed(f"preprocessing failed unexpectedly: {type(exc).__name__}: {exc}")
        return TaskDone(task.task_id, error=exc)
    return TaskDone(task.task_id, handle=handle, grid=grid, video_info=video_info, digest=digest)


def _set_process_name(name: bytes) -> None:
    """Linux `comm` (as mmserve.process_name does; preprocess imports nothing from mmserve), so
    `ps` and the benchmarks' CPU accounting tell the workers apart."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(ctypes.util.find_library("c")).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)


def worker_main(conn: Connection, settings: ImageTransform) -> None:
    """Entry point of a worker process; returns when told to (None) or when the pool is gone."""
    # Ctrl-C belongs to the pool process, which shuts workers down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_process_name(b"mmserve-prep")
    resample.kernel()  # build or load them now, so that no request waits for the compiler
    patchify.kernel()
    conn.send(WorkerReady(os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            conn.send(run_task(task, settings))
        except (BrokenPipeError, ConnectionResetError):
            return  # the pool process is gone; its resource tracker reclaims the segment
