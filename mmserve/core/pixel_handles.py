"""EngineCore's side of pixels by handle: read an image's pixels out of the preprocess pool's
shared memory into an array of its own, once, on receipt (pixel_store.py).

The API server pins the segment until EngineCore reports the handle's use id released, so a
read here normally finds the pixels it was sent. It trusts nothing of that: a segment that is
gone, shorter than the pixels, or whose bytes no longer hash to the handle's digest (recycled
for another image, overwritten during the read) gives None — the store keeps the image as
unreadable, and a request needing it fails; none encodes wrong pixels.
"""

from __future__ import annotations

import _posixshmem  # what multiprocessing.shared_memory opens segments with
import os

import numpy as np
import xxhash

from mmserve.protocol import PixelHandle


def read_pixels(handle: PixelHandle) -> np.ndarray | None:
    """A private copy of the handle's pixels, or None if the segment does not hold them (or the
    handle names no segment, shape or dtype that can be read: the store must not half-apply a
    request's changes)."""
    try:
        fd = _posixshmem.shm_open("/" + handle.shm_name, os.O_RDONLY, mode=0o600)
    except (OSError, ValueError):
        return None
    try:
        if os.fstat(fd).st_size < handle.nbytes:
            return None
        pixels = np.empty(handle.shape, dtype=handle.dtype)  # [num_patches, C·T·P·P]
        if not _read_into(fd, memoryview(pixels).cast("B")):
            return None
    except (OSError, TypeError, ValueError):
        return None
    finally:
        os.close(fd)
    if xxhash.xxh3_64_intdigest(pixels.data) != handle.digest:  # as preprocess.hashing.pixels_digest
        return None
    return pixels


def _read_into(fd: int, buffer: memoryview) -> bool:
    """Fill `buffer` from the start of `fd` (a plain read: no mapping to outlive the segment);
    False if the file ends first."""
    done = 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:]], done)
        if count == 0:
            return False
        done += count
    return True
