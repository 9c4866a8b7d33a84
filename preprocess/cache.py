"""LRU cache of processed images keyed by image id, bounded in bytes of pixels."""

from __future__ import annotations

import threading
from collections import OrderedDict

from preprocess.processed import SharedPixels


class ImageCache:
    """Holds one reference on each cached `SharedPixels`; eviction drops it, so pixels still
    used by a live `ProcessedImage` stay mapped and linked until that user releases them.

    Thread-safe. `get` hands out a reference under the same lock eviction takes, so an entry
    found here cannot be freed before the caller holds it.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.queries = 0
        self.hits = 0
        self._entries: OrderedDict[str, SharedPixels] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, mm_hash: str, *, count: bool = True) -> SharedPixels | None:
        """The entry for `mm_hash` with one reference acquired for the caller, or None.

        `count=False` leaves the query/hit counters alone (for a repeated internal look-up).
        """
        with self._lock:
            entry = self._entries.get(mm_hash)
            if count:
                self.queries += 1
                self.hits += entry is not None
            if entry is None:
                return None
            self._entries.move_to_end(mm_hash)
            entry.acquire()
            return entry

    def put(self, mm_hash: str, entry: SharedPixels) -> None:
        """Cache `entry` (acquiring a reference), evicting least recently used entries to fit.
        An entry larger than the whole capacity is not cached."""
        if entry.nbytes > self.capacity_bytes:
            return
        evicted: list[SharedPixels] = []
        with self._lock:
            if mm_hash in self._entries:
                return
            while self.used_bytes + entry.nbytes > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.used_bytes -= old.nbytes
                evicted.append(old)
            entry.acquire()
            self._entries[mm_hash] = entry
            self.used_bytes += entry.nbytes
        for old in evicted:
            old.release()

    def segment_names(self) -> set[str]:
        with self._lock:
            return {entry.handle.shm_name for entry in self._entries.values()}

    def clear(self) -> None:
        """Drop every entry (releasing the cache's references)."""
        with self._lock:
            evicted = list(self._entries.values())
            self._entries.clear()
            self.used_bytes = 0
        for old in evicted:
            old.release()
