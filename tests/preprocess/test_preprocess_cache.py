"""The byte-bounded LRU cache and the reference counts that keep segments alive."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator

import pytest

from preprocess import shm
from preprocess.cache import ImageCache
from preprocess.processed import ProcessedImage, SharedPixels

ROWS = 256  # one entry: [256, 1] float32 = 1 KiB
ENTRY_BYTES = ROWS * 4


@pytest.fixture
def make_entry() -> Iterator[Callable[[str], SharedPixels]]:
    """`make_entry(key)`: a real 1 KiB segment; the test must leave none behind."""
    prefix = f"{shm.SEGMENT_PREFIX}cachetest{secrets.token_hex(3)}_"

    def make(key: str) -> SharedPixels:
        handle = shm.ShmHandle(prefix + key, (ROWS, 1))
        shm.map_writable(handle, ENTRY_BYTES, create=True)[:] = float(len(key))
        return SharedPixels(key, handle, (1, 16, 16), 64, ENTRY_BYTES, lambda name, _: shm.unlink(name))

    yield make
    assert shm.list_segments(prefix) == []


def linked(entry: SharedPixels) -> bool:
    return os.path.exists(f"/dev/shm/{entry.handle.shm_name}")


def test_lru_eviction_is_by_bytes_and_recency(make_entry: Callable[[str], SharedPixels]) -> None:
    cache = ImageCache(capacity_bytes=3 * ENTRY_BYTES)
    entries = {key: make_entry(key) for key in "abcd"}
    for key in "abc":
        cache.put(key, entries[key])
        entries[key].release()  # the cache holds the only reference now
    cache.get("a").release()  # a is now the most recently used
    cache.put("d", entries["d"])
    entries["d"].release()
    assert cache.get("b") is None
    assert [cache.get(key) is not None for key in "acd"] == [True, True, True]
    assert not linked(entries["b"])  # evicted with no other user: unlinked at once
    assert cache.used_bytes == 3 * ENTRY_BYTES and len(cache) == 3
    for key in "acd":
        entries[key].release()  # the references the three gets above acquired
    cache.clear()
    assert all(not linked(entry) for entry in entries.values())


def test_evicted_entry_lives_until_its_last_user_releases(make_entry: Callable[[str], SharedPixels]) -> None:
    cache = ImageCache(capacity_bytes=ENTRY_BYTES)
    held = make_entry("held")
    cache.put("held", held)
    user = ProcessedImage(held)  # adopts the creator's reference
    newcomer = make_entry("new")
    cache.put("new", newcomer)  # evicts "held"
    newcomer.release()
    assert cache.get("held", count=False) is None
    assert linked(held)
    assert user.pixel_values[0, 0] == 4.0  # still readable
    user.release()
    assert not linked(held)
    cache.clear()


def test_entry_larger_than_the_cache_is_not_cached(make_entry: Callable[[str], SharedPixels]) -> None:
    cache = ImageCache(capacity_bytes=ENTRY_BYTES - 1)
    entry = make_entry("big")
    cache.put("big", entry)
    assert len(cache) == 0
    entry.release()
    assert not linked(entry)


def test_counters_count_queries_and_hits(make_entry: Callable[[str], SharedPixels]) -> None:
    cache = ImageCache(capacity_bytes=ENTRY_BYTES)
    entry = make_entry("k")
    assert cache.get("k") is None
    cache.put("k", entry)
    entry.release()
    cache.get("k").release()
    cache.get("k", count=False).release()
    assert (cache.queries, cache.hits) == (2, 1)
    cache.clear()


def test_released_image_refuses_pixel_access(make_entry: Callable[[str], SharedPixels]) -> None:
    image = ProcessedImage(make_entry("gone"))
    with image:
        assert image.pixel_values.shape == (ROWS, 1)
    assert image.released
    with pytest.raises(RuntimeError, match="image gone was released"):
        _ = image.pixel_values
    image.release()  # idempotent
