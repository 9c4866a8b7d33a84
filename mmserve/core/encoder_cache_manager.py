"""Bookkeeping for the encoder cache: which image embeddings exist, who still needs them.

Storage lives in the worker; this class only decides. Capacity is counted in embeddings (one
per placeholder token). An entry is referenced by every request whose computation has reached
that image and not yet passed it (an image repeated in one prompt is referenced again at each
occurrence); unreferenced entries stay cached (a later request or occurrence with the same image
gets them for free) in LRU order until space is needed. Hashes evicted since the last step are
handed to the worker, which drops the tensors. An item evicted here is encoded again from the
pixels its request holds (core/pixel_store.py) when a request reaches it.

The scheduler asks `can_allocate` and `num_references` every step, so both are answered from
counters kept up to date on every transition, never by scanning the entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # capacity not taken by any entry, referenced or not
        self.num_evictable_slots = 0  # capacity taken by unreferenced entries
        self.sizes: dict[str, int] = {}  # mm_hash → embeddings
        self.refs: dict[str, set[str]] = {}  # mm_hash → request ids referencing it
        self.unreferenced: OrderedDict[str, None] = OrderedDict()  # eviction order, oldest first
        self.freed: list[str] = []
        self.num_hits = 0  # an image found in the cache instead of being encoded
        self._num_references = 0  # sum of len(refs[h]) over every entry

    def is_cached(self, mm_hash: str) -> bool:
        return mm_hash in self.sizes

    def can_allocate(self, num_embeddings: int, keep: Collection[str] = ()) -> bool:
        """Room for `num_embeddings` more, counting what evicting unreferenced entries would free,
        except those in `keep` (cached entries the caller is about to reference). O(len(keep))."""
        kept = sum(self.sizes[h] for h in keep if h in self.unreferenced)
        return num_embeddings <= self.num_free_slots + self.num_evictable_slots - kept

    def allocate(self, mm_hash: str, num_embeddings: int, request_id: str) -> None:
        """Reserve space for an image about to be encoded, evicting LRU unreferenced entries."""
        while num_embeddings > self.num_free_slots:
            victim, _ = self.unreferenced.popitem(last=False)
            size = self.sizes.pop(victim)
            self.num_evictable_slots -= size
            self.num_free_slots += size
            del self.refs[victim]
            self._drop(victim)
        self.num_free_slots -= num_embeddings
        self.sizes[mm_hash] = num_embeddings
        self.refs[mm_hash] = {request_id}
        self._num_references += 1

    def add_reference(self, mm_hash: str, request_id: str) -> None:
        """A request will read a cached entry: keep it from eviction."""
        refs = self.refs[mm_hash]
        if not refs:
            del self.unreferenced[mm_hash]
            self.num_evictable_slots -= self.sizes[mm_hash]
        if request_id not in refs:
            refs.add(request_id)
            self._num_references += 1
            self.num_hits += 1

    def release(self, mm_hash: str, request_id: str) -> None:
        refs = self.refs.get(mm_hash)
        if refs is None or request_id not in refs:
            return
        refs.discard(request_id)
        self._num_references -= 1
        if not refs:
            self.unreferenced[mm_hash] = None
            self.num_evictable_slots += self.sizes[mm_hash]

    def release_all(self, request_id: str, mm_hashes: list[str]) -> None:
        for mm_hash in mm_hashes:
            self.release(mm_hash, request_id)

    def discard(self, mm_hash: str) -> None:
        """Forget an entry whose embeddings may never have been stored (its step failed); the
        worker is told to drop whatever it holds under the hash."""
        if mm_hash not in self.sizes:
            return
        size = self.sizes.pop(mm_hash)
        if mm_hash in self.unreferenced:
            del self.unreferenced[mm_hash]
            self.num_evictable_slots -= size
        self.num_free_slots += size
        self._num_references -= len(self.refs.pop(mm_hash))
        self._drop(mm_hash)

    def _drop(self, mm_hash: str) -> None:
        self.freed.append(mm_hash)

    def num_references(self) -> int:
        """(request, image) references held, over all entries."""
        return self._num_references

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def return_freed(self, mm_hashes: list[str]) -> None:
        """Hashes handed out with a step the runner never received (the step failed): they are
        handed out again with the next one."""
        self.freed.extend(mm_hashes)
