"""Encoder-cache bookkeeping: references, LRU eviction of unreferenced entries only, the freed
list, and hit counting."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmserve.core.encoder_cache_manager import EncoderCacheManager


def test_allocating_takes_room_and_references_the_entry_for_its_request():
    cache = EncoderCacheManager(10)
    cache.allocate("img-a", 6, "r1")
    assert cache.is_cached("img-a") and not cache.is_cached("img-b")
    assert cache.num_free_slots == 4
    assert cache.refs == {"img-a": {"r1"}}
    assert cache.num_references() == 1
    assert cache.num_hits == 0  # encoding is not a hit


def test_a_second_request_reading_a_cached_entry_is_one_hit():
    cache = EncoderCacheManager(10)
    cache.allocate("img-a", 6, "r1")
    cache.add_reference("img-a", "r2")
    cache.add_reference("img-a", "r2")  # the same request again (a later chunk): no new hit
    assert cache.refs["img-a"] == {"r1", "r2"}
    assert cache.num_hits == 1


def test_releasing_the_last_reference_keeps_the_entry_cached_but_evictable():
    cache = EncoderCacheManager(10)
    cache.allocate("img-a", 6, "r1")
    cache.add_reference("img-a", "r2")
    cache.release("img-a", "r1")
    assert "img-a" not in cache.unreferenced
    cache.release("img-a", "r2")
    assert cache.is_cached("img-a") and list(cache.unreferenced) == ["img-a"]
    assert cache.num_free_slots == 4 and cache.take_freed() == []


def test_release_is_idempotent_and_ignores_unknown_entries():
    cache = EncoderCacheManager(10)
    cache.allocate("img-a", 6, "r1")
    cache.release("img-a", "r1")
    cache.release("img-a", "r1")
    cache.release("img-x", "r1")
    assert list(cache.unreferenced) == ["img-a"] and cache.num_references() == 0


def test_referencing_an_unreferenced_entry_takes_it_out_of_the_eviction_order():
    cache = EncoderCacheManager(10)
    cache.allocate("img-a", 6, "r1")
    cache.release("img-a", "r1")
    cache.add_reference("img-a", "r2")
    assert not cache.unreferenced and cache.num_hits == 1
    assert not cache.can_allocate(5)


def test_eviction_takes_unreferenced_entries_oldest_first_and_only_as_many_as_needed():
    cache = EncoderCacheManager(12)
    for name in ("img-a", "img-b", "img-c"):
        cache.allocate(name, 4, "r1")
    for name in ("img-b", "img-a", "img-c"):  # released in this order: b is the oldest
        cache.release(name, "r1")
    cache.allocate("img-d", 6, "r2")
    assert cache.take_freed() == ["img-b", "img-a"]
    assert not cache.is_cached("img-b") and not cache.is_cached("img-a")
    assert cache.is_cached("img-c") and cache.num_free_slots == 2


def test_referenced_entries_are_never_evicted():
    cache = EncoderCacheManager(12)
    cache.allocate("img-a", 4, "r1")
    cache.allocate("img-b", 4, "r2")
    cache.release("img-b", "r2")
    assert cache.can_allocate(8) and not cache.can_allocate(9)
    cache.allocate("img-c", 8, "r3")
    assert cache.take_freed() == ["img-b"]
    assert cache.is_cached("img-a")


def test_can_allocate_counts_free_and_evictable_room_but_not_kept_entries():
    cache = EncoderCacheManager(10)
    cache.allocate("img-a", 4, "r1")
    cache.allocate("img-b", 3, "r1")
    cache.release("img-a", "r1")
    assert cache.can_allocate(7) and not cache.can_allocate(8)
    assert not cache.can_allocate(4, keep={"img-a"})  # about to be read again: not room
    assert cache.can_allocate(3, keep={"img-a"})


def test_the_freed_list_is_handed_out_once():
    cache = EncoderCacheManager(4)
    cache.allocate("img-a", 4, "r1")
    cache.release("img-a", "r1")
    cache.allocate("img-b", 4, "r2")
    assert cache.take_freed() == ["img-a"]
    assert cache.take_freed() == []


def test_release_all_drops_every_reference_of_a_request():
    cache = EncoderCacheManager(10)
    cache.allocate("img-a", 4, "r1")
    cache.allocate("img-b", 4, "r1")
    cache.add_reference("img-a", "r2")
    cache.release_all("r1", ["img-a", "img-b", "img-a"])
    assert cache.refs == {"img-a": {"r2"}, "img-b": set()}
    assert list(cache.unreferenced) == ["img-b"]


# ---------------------------------------------------------------------------- property


SIZES = {"img-a": 3, "img-b": 5, "img-c": 8, "img-d": 4, "img-e": 2}


class EncoderCacheMachine(RuleBasedStateMachine):
    """Random encode / read / release sequences, allocating only when `can_allocate` says so."""

    CAPACITY = 12
    REQUESTS = ("r1", "r2", "r3")

    def __init__(self) -> None:
        super().__init__()
        self.cache = EncoderCacheManager(self.CAPACITY)
        self.held: set[tuple[str, str]] = set()  # (mm_hash, request id) the model says is referenced
        self.freed: list[str] = []  # evicted since the runner last took the list
        self.hits = 0

    @rule(mm_hash=st.sampled_from(sorted(SIZES)), request_id=st.sampled_from(REQUESTS))
    def need(self, mm_hash, request_id):
        if self.cache.is_cached(mm_hash):
            if not self.cache.refs[mm_hash] or request_id not in self.cache.refs[mm_hash]:
                self.hits += 1
            self.cache.add_reference(mm_hash, request_id)
        elif self.cache.can_allocate(SIZES[mm_hash]):
            # Expected victims: unreferenced entries, least recently released first, until it fits.
            victims, room = [], self.cache.num_free_slots
            for candidate in self.cache.unreferenced:
                if room >= SIZES[mm_hash]:
                    break
                victims.append(candidate)
                room += self.cache.sizes[candidate]
            self.cache.allocate(mm_hash, SIZES[mm_hash], request_id)
            assert self.cache.freed == self.freed + victims
            self.freed += victims
        else:
            return
        self.held.add((mm_hash, request_id))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        mm_hash, request_id = data.draw(st.sampled_from(sorted(self.held)))
        self.cache.release(mm_hash, request_id)
        self.held.discard((mm_hash, request_id))

    @rule()
    def take_freed(self):
        assert self.cache.take_freed() == self.freed  # each eviction handed out once
        self.freed = []

    @invariant()
    def consistent(self):
        cache = self.cache
        assert cache.num_free_slots >= 0
        assert cache.num_free_slots + sum(cache.sizes.values()) == self.CAPACITY
        assert set(cache.refs) == set(cache.sizes)
        assert set(cache.unreferenced) == {h for h, refs in cache.refs.items() if not refs}
        assert {(h, r) for h, refs in cache.refs.items() for r in refs} == self.held
        assert cache.num_references() == len(self.held)
        assert cache.num_hits == self.hits


TestEncoderCacheMachine = EncoderCacheMachine.TestCase
TestEncoderCacheMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class EncoderCacheCountersMachine(RuleBasedStateMachine):
    """The O(1) answers (`num_references`, and `can_allocate` through the evictable-room counter)
    against a brute-force recount over every entry, through any sequence of operations, including
    the failed-step `discard` of referenced and unreferenced entries."""

    CAPACITY = 12
    REQUESTS = ("r1", "r2", "r3")

    def __init__(self) -> None:
        super().__init__()
        self.cache = EncoderCacheManager(self.CAPACITY)

    @rule(mm_hash=st.sampled_from(sorted(SIZES)), request_id=st.sampled_from(REQUESTS))
    def need(self, mm_hash, request_id):
        if self.cache.is_cached(mm_hash):
            self.cache.add_reference(mm_hash, request_id)
        elif self.cache.can_allocate(SIZES[mm_hash]):
            self.cache.allocate(mm_hash, SIZES[mm_hash], request_id)

    @rule(mm_hash=st.sampled_from(sorted(SIZES)), request_id=st.sampled_from(REQUESTS))
    def release(self, mm_hash, request_id):
        self.cache.release(mm_hash, request_id)

    @rule(request_id=st.sampled_from(REQUESTS))
    def release_all(self, request_id):
        self.cache.release_all(request_id, sorted(SIZES))

    @rule(mm_hash=st.sampled_from(sorted(SIZES)))
    def discard(self, mm_hash):
        self.cache.discard(mm_hash)

    @invariant()
    def counters_match_a_recount(self):
        cache = self.cache
        assert cache.num_references() == sum(len(refs) for refs in cache.refs.values())
        evictable = sum(cache.sizes[h] for h in cache.unreferenced)
        assert cache.num_evictable_slots == evictable
        assert cache.num_free_slots + sum(cache.sizes.values()) == self.CAPACITY

    @invariant()
    def can_allocate_matches_a_recount(self):
        cache = self.cache
        for keep in ((), ("img-a",), ("img-b", "img-c"), tuple(cache.sizes)):
            room = cache.num_free_slots + sum(cache.sizes[h] for h in cache.unreferenced if h not in keep)
            for num_embeddings in (0, room, room + 1):
                assert cache.can_allocate(num_embeddings, keep=keep) == (num_embeddings <= room)


TestEncoderCacheCountersMachine = EncoderCacheCountersMachine.TestCase
TestEncoderCacheCountersMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
