"""Freed segments kept for reuse.

Writing into a fresh segment costs a page fault and a zeroed page per 4 KiB, about as much as
the whole normalise-and-patchify step; an existing segment's pages are already there. So a
segment whose last user lets go comes here instead of being unlinked, up to a byte budget.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from preprocess import shm


class SpareSegments:
    """Free segments by size (see `shm.segment_size`), at most `capacity_bytes` in total.
    Thread-safe. Whatever does not fit is unlinked at once."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.held_bytes = 0
        self._by_size: defaultdict[int, list[str]] = defaultdict(list)
        self._closed = False
        self._lock = threading.Lock()

    def take(self, segment_bytes: int) -> str | None:
        """Name of a spare segment of exactly `segment_bytes`, now the caller's; None if none."""
        with self._lock:
            names = self._by_size.get(segment_bytes)
            if not names:
                return None
            self.held_bytes -= segment_bytes
            return names.pop()

    def give(self, shm_name: str, segment_bytes: int) -> None:
        """Keep the segment for reuse if it fits the budget (and we are open), else unlink it."""
        with self._lock:
            keep = not self._closed and self.held_bytes + segment_bytes <= self.capacity_bytes
            if keep:
                self._by_size[segment_bytes].append(shm_name)
                self.held_bytes += segment_bytes
        if not keep:
            shm.unlink(shm_name)

    def names(self) -> set[str]:
        with self._lock:
            return {name for group in self._by_size.values() for name in group}

    def close(self) -> None:
        """Unlink every spare; from now on every segment given is unlinked."""
        with self._lock:
            self._closed = True
            names = [name for group in self._by_size.values() for name in group]
            self._by_size.clear()
            self.held_bytes = 0
        for name in names:
            shm.unlink(name)
