"""`PreprocessPool`: the one object the frontend calls to turn an image or a video into pixels.

A request is hashed once; a cache hit returns at once (no IPC); a request for an image already
being computed waits for that computation; otherwise its header is checked (a bad image fails
here, before any queue), it takes an admission slot (backpressure) and goes to a worker.
Results live in shared memory, reference counted; freed segments are recycled. A result sent
to another process by handle is pinned (`pin`) until that process has taken its copy (`unpin`).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import secrets
import threading
from collections.abc import Iterable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from PIL import Image

from preprocess import hashing, shm
from preprocess.cache import ImageCache
from preprocess.decode import ImageSource, RawImage
from preprocess.errors import (
    CorruptImage,
    ImageError,
    PreprocessFailed,
    PreprocessPoolClosed,
    PreprocessWorkerDied,
)
from preprocess.gate import AdmissionGate
from preprocess.pins import Pins
from preprocess.probe import pixel_values_nbytes
from preprocess.processed import ProcessedImage, SharedPixels
from preprocess.spares import SpareSegments
from preprocess.supervisor import InlineExecutor, WorkerSupervisor
from preprocess.transform import ImageTransform
from preprocess.video import VideoSource, plan, video_pixel_values_nbytes
from preprocess.worker import Task, TaskDone

PoolInput = bytes | Image.Image | VideoSource  # a video carries its own settings and sampling
_Claim = ProcessedImage | Future  # a cache hit, or a computation's result to wait for


@dataclass(frozen=True)
class PoolStats:
    cache_queries: int  # requests that looked in the cache (one per process call)
    cache_hits: int  # ... and found their image there
    shared_computations: int  # requests that joined a computation already in flight
    tasks_submitted: int  # computations handed to a worker (or run inline)
    pending: int  # computations accepted and not finished (bounded by max_pending)
    worker_restarts: int
    cached_images: int
    cached_bytes: int
    spare_bytes: int  # freed segments kept for reuse
    pinned: int  # handles sent to another process and not yet reported taken (see `pin`)


class PreprocessPool:
    """Preprocess images in `num_workers` spawned processes (0: inline, for debugging).

    `cache_bytes` bounds the LRU cache of results and `spare_bytes` the freed segments kept
    for reuse (both in bytes of shared memory); `max_pending` bounds computations accepted at
    once (queued or running): beyond it `process` blocks and `process_async` waits.
    Thread-safe; `process_async` may be used from any number of event loops.
    """

    def __init__(
        self,
        settings: ImageTransform,
        num_workers: int | None = None,
        cache_bytes: int = 1 << 30,
        max_pending: int | None = None,
        spare_bytes: int = 256 << 20,
    ) -> None:
        if num_workers is None:
            num_workers = min(4, os.cpu_count() or 1)
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.settings = settings
        # Every segment name of this pool starts with this; close() sweeps exactly these.
        self.segment_prefix = f"{shm.SEGMENT_PREFIX}{secrets.token_hex(4)}_"
        self._cache = ImageCache(cache_bytes)
        self._spares = SpareSegments(spare_bytes)
        self._pins = Pins()
        self._gate = AdmissionGate(max_pending or max(8, 4 * num_workers))
        self._jobs: dict[str, list[Future]] = {}  # image id -> waiters of its running computation
        self._task_ids = itertools.count()
        self._shared_computations = 0
        self._closed = False
        self._lock = threading.Lock()
        self._executor: InlineExecutor | WorkerSupervisor
        if num_workers == 0:
            self._executor = InlineExecutor(settings, self._on_done)
        else:
            self._executor = WorkerSupervisor(settings, num_workers, self._on_done)
        # A pool left open at exit would leave its segments to the resource tracker's warnings.
        atexit.register(self.close)

    def process(self, image: PoolInput, mm_hash: str | None = None) -> ProcessedImage:
        """Blocking: the processed image (release it when done). Raises `ImageError` for a bad
        image, `PreprocessError` if the pool failed. Pass `mm_hash` if already computed."""
        mm_hash, source = self._identify(image, mm_hash)
        claim = self._claim(mm_hash, count=True)
        if claim is None:
            segment_bytes = self._segment_bytes(source)
            self._gate.acquire()
            claim = self._start(mm_hash, source, segment_bytes)
        return claim if isinstance(claim, ProcessedImage) else claim.result()

    async def process_async(self, image: PoolInput, mm_hash: str | None = None) -> ProcessedImage:
        """`process` for asyncio: never blocks the loop. Hashing and the header check run in a
        thread (their cost grows with the image: megabytes to hash, a header to parse); the
        slot and the result are awaited."""
        mm_hash, source = await asyncio.to_thread(self._identify, image, mm_hash)
        claim = self._claim(mm_hash, count=True)
        if claim is None:
            segment_bytes = await asyncio.to_thread(self._segment_bytes, source)
            await self._gate.acquire_async()
            claim = self._start(mm_hash, source, segment_bytes)
        return claim if isinstance(claim, ProcessedImage) else await asyncio.wrap_future(claim)

    def stats(self) -> PoolStats:
        return PoolStats(
            cache_queries=self._cache.queries,
            cache_hits=self._cache.hits,
            shared_computations=self._shared_computations,
            tasks_submitted=self._executor.tasks_dispatched,
            pending=len(self._jobs),
            worker_restarts=self._executor.restarts,
            cached_images=len(self._cache),
            cached_bytes=self._cache.used_bytes,
            spare_bytes=self._spares.held_bytes,
            pinned=len(self._pins),
        )

    def pin(self, image: ProcessedImage) -> int:
        """Keep `image`'s segment linked and unrecycled for a reader in another process, however
        the cache evicts meanwhile, until `unpin` with the use id returned. RuntimeError if
        `image` was released."""
        return self._pins.pin(image)

    def unpin(self, use_ids: Iterable[int]) -> None:
        """The readers of these use ids have their copies (unknown ids are ignored)."""
        self._pins.unpin(use_ids)

    def unpin_all(self) -> None:
        """The reading process is gone: no pin is needed any more."""
        self._pins.unpin_all()

    def segments_in_use(self) -> list[str]:
        """This pool's segments that neither the cache nor the spares hold: those of results
        still referenced by a caller or a pin (or computing). With nothing in flight, any is a
        leak."""
        held = self._cache.segment_names() | self._spares.names()
        return [name for name in shm.list_segments(self.segment_prefix) if name not in held]

    def worker_pids(self) -> list[int]:
        """Process ids of the workers, in worker-index order (empty when inline)."""
        return self._executor.worker_pids()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until every worker process has started; False on timeout. Requests need not
        wait for this (they queue); it is for start-up health checks and tests."""
        return self._executor.wait_ready(timeout_s)

    def close(self) -> None:
        """Stop the workers, fail what is unfinished, and unlink every segment of this pool.
        Arrays already handed out stay readable (their mapping outlives the name)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._gate.close()
        self._executor.close()
        self._pins.unpin_all()
        self._cache.clear()
        self._spares.close()
        for name in shm.list_segments(self.segment_prefix):
            shm.unlink(name)

    def __enter__(self) -> PreprocessPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _identify(self, image: PoolInput, mm_hash: str | None) -> tuple[str, ImageSource | VideoSource]:
        if self._closed:
            raise PreprocessPoolClosed("the preprocess pool is closed")
        if isinstance(image, VideoSource):
            return mm_hash or image.digest(), image
        if isinstance(image, Image.Image):
            try:
                source: ImageSource = RawImage.from_pil(image)
            except OSError as exc:  # a lazily opened PIL image whose data is truncated
                raise CorruptImage(f"image data is truncated or corrupt: {exc}") from None
        elif isinstance(image, bytes | bytearray | memoryview):
            source = bytes(image)
        else:
            raise TypeError(f"expected bytes or PIL.Image.Image, got {type(image).__name__}")
        return mm_hash or hashing.mm_hash(source, self.settings), source

    def _segment_bytes(self, source: ImageSource | VideoSource) -> int:
        """Checks the header (raising `ImageError`) and sizes the segment for the result."""
        if isinstance(source, VideoSource):
            return shm.segment_size(video_pixel_values_nbytes(plan(source).grid, source.settings))
        return shm.segment_size(pixel_values_nbytes(source, self.settings))

    def _claim(self, mm_hash: str, *, count: bool) -> _Claim | None:
        with self._lock:
            return self._claim_locked(mm_hash, count=count)

    def _claim_locked(self, mm_hash: str, *, count: bool) -> _Claim | None:
        """A cache hit, or a seat on the running computation, or None. Call with the lock held:
        `_on_done` caches a result and retires its job under the same lock, so nothing slips
        between the two look-ups."""
        shared = self._cache.get(mm_hash, count=count)
        if shared is not None:
            return ProcessedImage(shared)
        waiters = self._jobs.get(mm_hash)
        if waiters is None:
            return None
        future: Future = Future()
        waiters.append(future)
        self._shared_computations += 1
        return future

    def _start(self, mm_hash: str, source: ImageSource, segment_bytes: int) -> _Claim:
        """Holding an admission slot: start the computation, or give the slot back if the
        image turned up (cached or in flight) while we waited for it."""
        task: Task | None = None
        with self._lock:
            claim = self._claim_locked(mm_hash, count=False)
            if claim is None:
                claim = Future()
                self._jobs[mm_hash] = [claim]
                task_id = next(self._task_ids)
                spare = self._spares.take(segment_bytes)
                shm_name = spare or f"{self.segment_prefix}{task_id:x}"
                task = Task(task_id, mm_hash, source, shm_name, segment_bytes, recycled=spare is not None)
        if task is None:
            self._gate.release()
            return claim
        try:
            self._executor.submit(task)
        except PreprocessPoolClosed as exc:
            self._on_done(task, TaskDone(task.task_id, error=exc))
        return claim

    def _on_done(self, task: Task, done: TaskDone) -> None:
        """Every task ends here exactly once (worker thread, or inline in the caller)."""
        shared: SharedPixels | None = None
        error = done.error
        if error is None:
            try:
                settings = task.source.settings if isinstance(task.source, VideoSource) else self.settings
                tokens = settings.num_tokens(done.grid)
                shared = SharedPixels(
                    task.mm_hash,
                    done.handle,
                    done.grid,
                    tokens,
                    task.segment_bytes,
                    self._spares.give,
                    done.digest,
                )
                shared.video_info = done.video_info
            except OSError as exc:
                error = PreprocessFailed(f"could not map the result of image {task.mm_hash}: {exc}")
        if error is not None:
            self._free_failed(task, error)
        with self._lock:
            if shared is not None:
                self._cache.put(task.mm_hash, shared)
            waiters = self._jobs.pop(task.mm_hash)
        self._gate.release()
        for future in waiters:
            if shared is None:
                _settle(future, error=error)
                continue
            shared.acquire()
            image = ProcessedImage(shared)
            if not _settle(future, result=image):
                image.release()
        if shared is not None:
            shared.release()  # the job's own reference

    def _free_failed(self, task: Task, error: Exception) -> None:
        """A spare survives a bad image or a dead worker intact; a new segment may be half-made,
        and after an unexpected failure nothing about the segment is trusted."""
        if task.recycled and isinstance(error, ImageError | PreprocessWorkerDied):
            self._spares.give(task.shm_name, task.segment_bytes)
        else:
            shm.unlink(task.shm_name)


def _settle(future: Future, *, result: ProcessedImage | None = None, error: Exception | None = None) -> bool:
    """Complete `future`; False if its waiter gave up (cancelled) meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True
