"""The frontend's mirror of EngineCore's pixel store: it alone decides what the store holds. A
request brings the pixels of its items the mirror does not list and names the least recently
used unheld entries to drop down to the capacity; what a prompt relies on (held) is never
dropped; a request that could not be sent is undone; what the engine could not read is dropped
with the next request."""

from __future__ import annotations

import gc

import pytest

from mmserve.frontend.pixel_store_mirror import PixelStoreMirror, StoreChange, StoredItem


def item(nbytes: int = 10) -> StoredItem:
    return StoredItem((1, 2, 2), 1, nbytes)


def send(mirror: PixelStoreMirror, *hashes: str, nbytes: int = 10) -> StoreChange:
    """One request bringing pixels for each of `hashes`, from a prompt released once sent."""
    holds = mirror.holds()
    change = mirror.commit({h: item(nbytes) for h in hashes}, holds)
    holds.release()
    return change


def test_an_item_goes_by_hash_only_once_listed_and_is_held_for_the_prompt():
    mirror = PixelStoreMirror(capacity_bytes=100)
    holds = mirror.holds()
    assert mirror.hold("a", holds) is None
    assert send(mirror, "a") == StoreChange(evict=[], add=["a"])
    assert mirror.hold("a", holds) == item() and mirror.num_held() == 1
    assert mirror.commit({"a": None}, holds) == StoreChange()  # by hash: nothing to bring
    holds.release()
    assert mirror.num_held() == 0


def test_least_recently_used_entries_are_evicted_down_to_the_capacity():
    mirror = PixelStoreMirror(capacity_bytes=30)
    for name in "abc":
        send(mirror, name)
    send(mirror, "a")  # a repeat: most recent now, nothing brought
    assert send(mirror, "d") == StoreChange(evict=["b"], add=["d"])
    assert send(mirror, "e", nbytes=20) == StoreChange(evict=["c", "a"], add=["e"])
    assert mirror.engine_keys() == {"d", "e"} and mirror.nbytes == 30


def test_held_entries_are_never_evicted_even_past_the_capacity():
    mirror = PixelStoreMirror(capacity_bytes=10)
    send(mirror, "a")
    early = mirror.holds()
    assert mirror.hold("a", early) is not None  # a prompt built now will send "a" by hash
    assert send(mirror, "b") == StoreChange(evict=[], add=["b"])  # over capacity: all held
    assert mirror.nbytes == 20
    assert mirror.commit({"a": None}, early) == StoreChange(evict=["b"])  # its send; "b" unheld now
    early.release()
    assert send(mirror, "c") == StoreChange(evict=["a"], add=["c"])


def test_a_prompts_later_requests_find_its_items_held():
    mirror = PixelStoreMirror(capacity_bytes=10)
    holds = mirror.holds()
    assert mirror.commit({"a": item()}, holds).add == ["a"]  # n > 1: the first brings the pixels
    send(mirror, "b")  # another prompt, between the two sends
    assert mirror.commit({"a": item()}, holds) == StoreChange(evict=["b"])  # the second: by hash
    holds.release()


def test_undoing_a_request_that_replaced_an_unreadable_entry_leaves_it_to_be_dropped():
    mirror = PixelStoreMirror(capacity_bytes=100)
    send(mirror, "a")
    mirror.drop(["a"])
    holds = mirror.holds()
    mirror.undo(mirror.commit({"a": item()}, holds))
    holds.release()
    assert "a" not in mirror and mirror.engine_keys() == {"a"}
    assert send(mirror, "b").evict == ["a"]


def test_a_request_not_sent_is_undone_its_evictions_sent_with_the_next_one():
    mirror = PixelStoreMirror(capacity_bytes=10)
    send(mirror, "a")
    holds = mirror.holds()
    change = mirror.commit({"b": item()}, holds)
    assert change == StoreChange(evict=["a"], add=["b"])
    mirror.undo(change)
    holds.release()
    assert "b" not in mirror and "a" not in mirror
    assert mirror.engine_keys() == {"a"}, "the engine still holds it"
    assert send(mirror, "c") == StoreChange(evict=["a"], add=["c"])
    assert mirror.engine_keys() == {"c"}


def test_an_item_the_engine_could_not_read_is_dropped_with_the_next_request_once_unheld():
    mirror = PixelStoreMirror(capacity_bytes=100)
    send(mirror, "a")
    holds = mirror.holds()
    mirror.hold("a", holds)
    mirror.drop(["a"])
    assert "a" not in mirror and mirror.engine_keys() == {"a"}
    assert send(mirror, "b").evict == [], "held: its prompt's request fails in the engine, clearly"
    assert mirror.commit({"a": None}, holds) == StoreChange()  # sent by hash to fail there
    holds.release()
    assert send(mirror, "c").evict == ["a"]
    mirror.drop(["a", "never-listed"])  # a report that arrives late changes nothing
    assert mirror.engine_keys() == {"b", "c"}


def test_an_item_sent_again_replaces_an_unreadable_entry():
    mirror = PixelStoreMirror(capacity_bytes=100)
    send(mirror, "a")
    mirror.drop(["a"])
    assert send(mirror, "a") == StoreChange(evict=[], add=["a"], relisted=["a"])
    assert send(mirror, "b").evict == [], "the new entry is not dropped"
    assert mirror.engine_keys() == {"a", "b"}


def test_an_item_without_pixels_the_engine_does_not_hold_is_refused_unchanged():
    mirror = PixelStoreMirror(capacity_bytes=10)
    send(mirror, "a")
    with pytest.raises(RuntimeError, match="not in the engine's store"):
        mirror.commit({"b": item(), "lost": None}, mirror.holds())
    assert mirror.engine_keys() == {"a"} and mirror.num_held() == 0


def test_a_prompt_dropped_unreleased_gives_its_holds_back():
    mirror = PixelStoreMirror(capacity_bytes=10)
    send(mirror, "a")
    holds = mirror.holds()
    mirror.hold("a", holds)
    del holds
    gc.collect()
    assert mirror.num_held() == 0
    assert send(mirror, "b").evict == ["a"]


def test_reset_forgets_the_engine():
    mirror = PixelStoreMirror(capacity_bytes=100)
    send(mirror, "a")
    mirror.drop(["a"])
    send(mirror, "b")
    mirror.reset()
    assert mirror.engine_keys() == set() and mirror.nbytes == 0
    assert mirror.hold("b", mirror.holds()) is None
