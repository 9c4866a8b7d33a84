"""Pins: a segment whose handle is in flight to another process is neither recycled nor unlinked,
however the cache evicts, until its use id is unpinned (or every pin is, the reader being gone);
and each result carries the digest a reader checks its copy against."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image
from preprocess_cases import encode, rgb_array
from test_preprocess_pool import SMALL_SEGMENT_BYTES, linked

from preprocess import PreprocessPool
from preprocess.hashing import pixels_digest
from preprocess.shm import attach

MakePool = Callable[..., PreprocessPool]


def small_images(count: int) -> list[bytes]:
    return [encode(Image.fromarray(rgb_array(56, 56, seed)), "PNG") for seed in range(count)]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_digest_is_that_of_the_pixels(num_workers: int, make_pool: MakePool) -> None:
    pool = make_pool(num_workers=num_workers)
    with pool.process(small_images(1)[0]) as image:
        assert image.digest == pixels_digest(image.pixel_values) != 0


def test_a_pinned_segment_is_neither_recycled_nor_unlinked_until_unpinned(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=0, cache_bytes=0, spare_bytes=2 * SMALL_SEGMENT_BYTES)
    first, second, third = small_images(3)
    image = pool.process(first)  # cache_bytes=0: the caller's reference is its only one
    handle, digest = image.handle, image.digest
    use_id = pool.pin(image)
    image.release()
    assert linked(handle.shm_name) and pool.stats().pinned == 1
    assert pool.segments_in_use() == [handle.shm_name]
    with pool.process(second) as other:  # a free segment of this size would be recycled here
        assert other.handle.shm_name != handle.shm_name
    assert pixels_digest(attach(handle)) == digest, "the pinned pixels are untouched"
    pool.unpin([use_id])
    assert pool.stats().pinned == 0 and pool.segments_in_use() == []
    with pool.process(third) as recycled:  # now it is a spare like any other
        assert recycled.handle.shm_name == handle.shm_name


def test_a_pinned_segment_outlives_its_cache_eviction(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=0, cache_bytes=SMALL_SEGMENT_BYTES, spare_bytes=0)
    first, second = small_images(2)
    with pool.process(first) as image:
        handle, use_id = image.handle, pool.pin(image)
        expected = np.array(image.pixel_values)
    pool.process(second).release()  # evicts the first image from the cache
    assert linked(handle.shm_name)
    np.testing.assert_array_equal(attach(handle), expected)
    pool.unpin([use_id])
    assert not linked(handle.shm_name), "evicted and unpinned: unlinked at once"


def test_unpinning_is_idempotent_and_unpin_all_gives_back_every_pin(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=0, cache_bytes=0, spare_bytes=0)
    images = [pool.process(data) for data in small_images(2)]
    names = [image.handle.shm_name for image in images]
    use_ids = [pool.pin(image) for image in images for _ in range(2)]
    for image in images:
        image.release()
    pool.unpin([use_ids[0], use_ids[0], 12345])  # once, twice, never pinned
    assert pool.stats().pinned == 3 and all(linked(name) for name in names)
    pool.unpin_all()
    assert pool.stats().pinned == 0 and not any(linked(name) for name in names)
    with pytest.raises(RuntimeError):
        pool.pin(images[0])  # released: its segment may be gone
