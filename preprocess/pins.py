"""Segments pinned for handles in flight to another process.

When pixels leave the pool by handle (segment name, shape, digest) rather than as an array, the
reader maps the segment later, in its own time. Until it says it has taken its copy, the segment
must be neither recycled for another image nor unlinked: each handle sent holds a reference of
its own (a "pin", named by a use id), which the reader's report, or the reader's death, gives back.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

from preprocess.processed import ProcessedImage


class Pins:
    """Use id → the reference that keeps its segment. Thread-safe; use ids start at 1."""

    def __init__(self) -> None:
        self._held: dict[int, ProcessedImage] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def pin(self, image: ProcessedImage) -> int:
        """A new use id holding `image`'s segment (RuntimeError if `image` was released)."""
        reference = image.new_reference()
        with self._lock:
            use_id = next(self._ids)
            self._held[use_id] = reference
        return use_id

    def unpin(self, use_ids: Iterable[int]) -> None:
        """Give back these pins; an unknown (or already given back) use id is ignored."""
        with self._lock:
            released = [self._held.pop(use_id, None) for use_id in use_ids]
        for reference in released:
            if reference is not None:
                reference.release()

    def unpin_all(self) -> None:
        """The reader is gone: give back every pin."""
        with self._lock:
            released, self._held = list(self._held.values()), {}
        for reference in released:
            reference.release()

    def __len__(self) -> int:
        return len(self._held)
