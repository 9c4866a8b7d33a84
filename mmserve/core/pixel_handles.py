"""EngineCore's side of pixels by handle: read an image's pixels out of the preprocess pool's
shared memory into an array of its own, once, on receipt.

The API server pins the segment until EngineCore reports the handle's use id released, so a
read here normally finds the pixels it was sent. It trusts nothing of that: a segment that is
gone, shorter than the pixels, or whose bytes no longer hash to the handle's digest (recycled
for another image, overwritten during the read) gives None, and the image is treated as sent
without pixels — its request waits for them (pixel_waits.py), never encodes wrong ones.
"""

from __future__ import annotations

import _posixshmem  # what multiprocessing.shared_memory opens segments with
import os

import numpy as np
import xxhash

from mmserve.protocol import MultiModalFeature, PixelHandle


def read_pixels(handle: PixelHandle) -> np.ndarray | None:
    """A private copy of the handle's pixels, or None if the segment does not hold them."""
    try:
        fd = _posixshmem.shm_open("/" + handle.shm_name, os.O_RDONLY, mode=0o600)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < handle.nbytes:
            return None
        pixels = np.empty(handle.shape, dtype=handle.dtype)  # [num_patches, C·T·P·P]
        if not _read_into(fd, memoryview(pixels).cast("B")):
            return None
    except OSError:
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


def resolve_handles(features: list[MultiModalFeature]) -> list[int]:
    """Replace each feature's handle by its pixels, or, where they cannot be read, mark it sent
    by hash (encoding it then waits for the frontend's pixels); the use ids of the handles. An
    image twice in one request is read once."""
    released = []
    read: dict[tuple[str, int, tuple[int, ...]], np.ndarray | None] = {}
    for f in features:
        handle = f.pixel_handle
        if handle is None:
            continue
        released.append(handle.use_id)
        key = (handle.shm_name, handle.digest, handle.shape)
        if key not in read:
            read[key] = read_pixels(handle)
        f.pixel_values = read[key]
        f.by_hash = f.pixel_values is None
        f.pixel_handle = None
    return released
