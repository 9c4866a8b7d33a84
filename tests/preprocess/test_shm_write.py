"""`shm.write_segment`: pixels written with pwrite read back through `attach`, into a new
segment or a recycled larger one; what it refuses, and that a segment it created but could not
fill is gone again."""

from __future__ import annotations

import os

import numpy as np
import pytest

from preprocess import shm


def _name(tag: str) -> str:
    return f"{shm.SEGMENT_PREFIX}writetest_{os.getpid()}_{tag}"


def test_new_and_recycled_segments_hold_the_pixels() -> None:
    pixels = np.random.default_rng(0).random((300, 1176), dtype=np.float32)
    handle = shm.ShmHandle(_name("new"), pixels.shape)
    try:
        shm.write_segment(handle, shm.segment_size(handle.nbytes), pixels, create=True)
        np.testing.assert_array_equal(shm.attach(handle), pixels)
        smaller = pixels[:100].copy()  # a recycled segment is larger than the next image's pixels
        shm.write_segment(shm.ShmHandle(handle.shm_name, smaller.shape), 0, smaller, create=False)
        np.testing.assert_array_equal(shm.attach(shm.ShmHandle(handle.shm_name, smaller.shape)), smaller)
    finally:
        shm.unlink(handle.shm_name)


def test_pixels_that_do_not_match_the_handle_are_refused() -> None:
    pixels = np.zeros((10, 12), dtype=np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        shm.write_segment(shm.ShmHandle(_name("t"), (12, 10)), 1 << 16, pixels.T, create=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        shm.write_segment(shm.ShmHandle(_name("n"), (11, 12)), 1 << 16, pixels, create=True)
    assert not shm.list_segments(_name(""))


def test_a_new_segment_too_small_for_the_pixels_is_unlinked() -> None:
    pixels = np.ones((64, 1024), dtype=np.float32)  # 256 KiB into a 64 KiB segment
    handle = shm.ShmHandle(_name("small"), pixels.shape)
    with pytest.raises(ValueError, match="smaller than"):
        shm.write_segment(handle, 1 << 16, pixels, create=True)
    assert not shm.list_segments(handle.shm_name)
