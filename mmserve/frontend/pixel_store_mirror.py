"""The frontend's mirror of EngineCore's pixel store (core/pixel_store.py): which items the
engine holds pixels for, decided here alone, as vLLM's mirrored processor caches do.

The mirror is an LRU of mm_hash → what sending the item by hash needs (its grid and token
count) and its pixels' size, bounded by `capacity_bytes` (--mm-processor-cache-gb). Each engine
request carries the mirror's decisions (`commit`): the pixels of its items the mirror lacks
(then listed), and the hashes the engine drops first to stay within the capacity (then
unlisted). EngineCore applies them in message order, the order `commit`s happen in, so after
every message the two hold the same keys — provided each committed request is sent at once
(before anything else can commit) or undone (`undo`) if it could not go.

A prompt *holds* the entries it relies on (`Holds`): the items it will send by hash from the
moment it was built, and every item once it has been sent (n > 1: its later engine requests go
by hash). A held entry is never evicted, so no send can race the eviction of what another
prompt, built earlier, relies on; entries may exceed the capacity while everything is held.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StoredItem:
    """What sending an item by hash needs, and the bytes its pixels take in the engine."""

    grid_thw: tuple[int, int, int]
    num_tokens: int
    nbytes: int


@dataclass(frozen=True)
class ByHashImage:
    """An image sent by hash: what `expand_placeholders` reads of a ProcessedImage, no pixels."""

    mm_hash: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    video_info: None = None

    def release(self) -> None:
        """Nothing to release: no shared memory is held (the prompt's `Holds` keep the entry)."""


@dataclass
class StoreChange:
    """One request's changes to the engine's store: hashes dropped first, then the ones whose
    pixels it brings."""

    evict: list[str] = field(default_factory=list)
    add: list[str] = field(default_factory=list)
    relisted: list[str] = field(default_factory=list)  # of `add`, those the engine held unlisted


class Holds:
    """The mirror entries one prompt holds (a hash once per prompt); `release` gives them back,
    as garbage collection does for a prompt dropped unreleased."""

    def __init__(self, mirror: PixelStoreMirror) -> None:
        self.hashes: set[str] = set()
        self._release = weakref.finalize(self, mirror._give_back, self.hashes)

    def release(self) -> None:
        """Idempotent."""
        self._release()

    @property
    def alive(self) -> bool:
        return self._release.alive


class PixelStoreMirror:
    """Thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, StoredItem] = OrderedDict()  # least recently used first
        self._held: dict[str, int] = {}  # mm_hash → prompts holding it
        # Hashes the engine holds that the mirror no longer lists (reported unreadable, or
        # evicted by a request that could not be sent): dropped with the next request, unless
        # a prompt still holds them (the engine then fails its by-hash items with a clear error).
        self._unlisted: dict[str, None] = {}
        self._given_back: deque[set[str]] = deque()  # Holds released, applied at the next call
        self._lock = threading.Lock()
        self.nbytes = 0  # pixel bytes of the listed entries
        self.images_by_hash = 0  # image items sent without pixels
        self.images_by_handle = 0  # ... by shared-memory handle: no pixel copy here
        self.images_with_pixels = 0  # ... with their pixels copied into the message

    def holds(self) -> Holds:
        return Holds(self)

    def hold(self, mm_hash: str, holds: Holds) -> StoredItem | None:
        """The item, if the engine holds it, held for `holds`'s prompt (sent by hash, then)."""
        with self._lock:
            self._apply_given_back()
            item = self._entries.get(mm_hash)
            if item is not None:
                self._entries.move_to_end(mm_hash)
                self._hold(mm_hash, holds)
            return item

    def commit(self, items: dict[str, StoredItem | None], holds: Holds) -> StoreChange:
        """Decide one request's store changes. `items`: each distinct item of the request, with
        its description where the request can bring its pixels (None: it cannot, it goes by
        hash). Items the engine holds go by hash (and become most recent); the others are
        listed, their pixels to go with the request. Then unheld entries are evicted, least
        recently used first, down to the capacity. Every item ends up held for `holds`.
        RuntimeError (and nothing changed) for an item given without pixels that the engine does
        not hold: the request could only fail there."""
        with self._lock:
            self._apply_given_back()
            lost = [  # (an unlisted one is unreadable: the request fails in the engine, clearly)
                h
                for h, item in items.items()
                if item is None and h not in self._entries and h not in self._unlisted
            ]
            if lost:
                raise RuntimeError(f"items {lost} have no pixels here and are not in the engine's store")
            change = StoreChange()
            for mm_hash, item in items.items():
                if mm_hash in self._entries:
                    self._entries.move_to_end(mm_hash)
                elif item is not None:
                    self._entries[mm_hash] = item
                    self.nbytes += item.nbytes
                    change.add.append(mm_hash)
                    if self._unlisted.pop(mm_hash, 0) is None:  # the new pixels replace the engine's
                        change.relisted.append(mm_hash)
                self._hold(mm_hash, holds)
            change.evict = [h for h in self._unlisted if not self._held.get(h)]
            for mm_hash in change.evict:
                del self._unlisted[mm_hash]
            excess = self.nbytes - self.capacity_bytes
            victims = []
            for mm_hash, item in self._entries.items():
                if excess <= 0:
                    break
                if not self._held.get(mm_hash):
                    victims.append(mm_hash)
                    excess -= item.nbytes
            for mm_hash in victims:
                self.nbytes -= self._entries.pop(mm_hash).nbytes
            change.evict += victims
            return change

    def undo(self, change: StoreChange) -> None:
        """The request `change` was committed for did not go, and nothing was committed since:
        the engine never got its pixels, and still holds what it would have evicted (dropped
        with the next request instead) and what it held unlisted. (Its holds stay with its
        prompt.)"""
        with self._lock:
            for mm_hash in change.add:
                item = self._entries.pop(mm_hash, None)
                if item is not None:
                    self.nbytes -= item.nbytes
            for mm_hash in [*change.relisted, *change.evict]:
                self._unlisted[mm_hash] = None

    def drop(self, mm_hashes: Iterable[str]) -> None:
        """Items whose pixels the engine could not read (EngineCoreOutputs.unreadable_pixels):
        never sent by hash again; a later request evicts them from the engine."""
        with self._lock:
            for mm_hash in mm_hashes:
                item = self._entries.pop(mm_hash, None)
                if item is not None:
                    self.nbytes -= item.nbytes
                    self._unlisted[mm_hash] = None

    def reset(self) -> None:
        """The engine is gone: it holds nothing."""
        with self._lock:
            self._entries.clear()
            self._unlisted.clear()
            self.nbytes = 0

    def engine_keys(self) -> set[str]:
        """What the engine's store holds after the last request committed (once it is applied)."""
        with self._lock:
            return set(self._entries) | set(self._unlisted)

    def num_held(self) -> int:
        """Entries held by some prompt."""
        with self._lock:
            self._apply_given_back()
            return len(self._held)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _hold(self, mm_hash: str, holds: Holds) -> None:
        if mm_hash not in holds.hashes and holds.alive:
            holds.hashes.add(mm_hash)
            self._held[mm_hash] = self._held.get(mm_hash, 0) + 1

    def _give_back(self, hashes: set[str]) -> None:
        """A `Holds` released (perhaps by garbage collection, in any thread and in the middle of
        another call: hence queued, not applied here)."""
        if hashes:
            self._given_back.append(hashes)

    def _apply_given_back(self) -> None:
        while self._given_back:
            for mm_hash in self._given_back.popleft():
                count = self._held[mm_hash] - 1
                if count:
                    self._held[mm_hash] = count
                else:
                    del self._held[mm_hash]
