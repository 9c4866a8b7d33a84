"""A processed image in shared memory, and each caller's reference to it."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np

from preprocess import shm
from preprocess.transform import GridTHW

FreeSegment = Callable[[str, int], None]  # (shm_name, segment_bytes): recycle or unlink


class SharedPixels:
    """One computed result: read-only pixels in a segment this process owns, reference counted.

    Every holder (the cache, each live `ProcessedImage`, the job that produced it) owns one
    reference; when the count reaches zero the segment goes to `free` (which recycles or
    unlinks it). The constructor returns with one reference, owned by its caller.
    """

    def __init__(
        self,
        mm_hash: str,
        handle: shm.ShmHandle,
        grid_thw: GridTHW,
        num_tokens: int,
        segment_bytes: int,
        free: FreeSegment,
        digest: int = 0,
    ) -> None:
        self.mm_hash = mm_hash
        self.handle = handle
        self.grid_thw = grid_thw
        self.num_tokens = num_tokens
        self.segment_bytes = segment_bytes
        self.digest = digest  # hashing.pixels_digest of the pixels: a by-handle reader checks it
        self.pixels = shm.attach(handle)
        self.video_info: object | None = None  # a video's `VideoInfo` (sampled frames, rate)
        self._free = free
        self._refs = 1
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Shared memory held (the whole segment, not just the pixels)."""
        return self.segment_bytes

    def acquire(self) -> None:
        with self._lock:
            if self._refs == 0:
                raise RuntimeError(f"shared-memory segment {self.handle.shm_name} was already freed")
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self._free(self.handle.shm_name, self.segment_bytes)


class ProcessedImage:
    """`pixel_values` [grid_h·grid_w, C·T·P·P] float32 (read-only, in shared memory) with
    `grid_thw` = (1, grid_h, grid_w) and `num_tokens` placeholder tokens.

    Adopts one reference on `shared` that the creator already holds, and gives it back on
    `release()` (or at the end of a `with` block, or at garbage collection as a safety net).
    Another process may map the same pixels read-only from `handle` (`preprocess.shm.attach`)
    and read them until this is released: after that the segment may be recycled for another
    image, so whoever reads in another process must finish (or copy) before the release (a
    `PreprocessPool.pin` holds a reference of its own for that), and may check its copy
    against `digest`.
    """

    def __init__(self, shared: SharedPixels) -> None:
        self._shared = shared
        self._release = weakref.finalize(self, shared.release)

    @property
    def mm_hash(self) -> str:
        return self._shared.mm_hash

    @property
    def grid_thw(self) -> GridTHW:
        return self._shared.grid_thw

    @property
    def num_tokens(self) -> int:
        return self._shared.num_tokens

    @property
    def digest(self) -> int:
        """`preprocess.hashing.pixels_digest` of `pixel_values`, computed by the worker."""
        return self._shared.digest

    @property
    def video_info(self):
        """For a video, which frames were sampled at what rate (`preprocess.video.VideoInfo`);
        None for an image."""
        return self._shared.video_info

    @property
    def pixel_values(self) -> np.ndarray:
        if self.released:
            raise RuntimeError(f"image {self.mm_hash} was released")
        return self._shared.pixels

    @property
    def handle(self) -> shm.ShmHandle:
        """Segment name, shape and dtype: what another process needs to attach."""
        return self._shared.handle

    @property
    def released(self) -> bool:
        return not self._release.alive

    def release(self) -> None:
        """Give up this reference (idempotent). Do not use `pixel_values` afterwards."""
        self._release()

    def new_reference(self) -> ProcessedImage:
        """Another reference to the same pixels, released on its own. RuntimeError if this one
        was released (the segment may be gone)."""
        if self.released:
            raise RuntimeError(f"image {self.mm_hash} was released")
        self._shared.acquire()
        return ProcessedImage(self._shared)

    def __enter__(self) -> ProcessedImage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else self.handle.shm_name
        return (
            f"ProcessedImage(mm_hash={self.mm_hash}, grid_thw={self.grid_thw}, "
            f"tokens={self.num_tokens}, {state})"
        )
