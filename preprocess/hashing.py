"""The mm_hash: one xxh3-128 hex digest per image, shared by every cache in the engine.

It covers the input (encoded bytes, or a PIL image's mode, size, palette, transparency and
pixels) and the transform settings' `digest`, so the same bytes under different settings get
different ids. A domain tag keeps encoded bytes and raw pixels from ever colliding by design.

`pixels_digest` is another thing: a checksum of a result's pixels, which a process reading them
from shared memory by handle recomputes to prove the segment still holds them.
"""

from __future__ import annotations

import numpy as np
import xxhash
from PIL import Image

from preprocess.decode import ImageSource, RawImage
from preprocess.transform import ImageTransform


def mm_hash(source: ImageSource | Image.Image, settings: ImageTransform) -> str:
    """32 hex characters identifying `source` as processed under `settings`. A PIL image
    hashes as its `RawImage` (convert once and pass that when both are needed)."""
    if isinstance(source, Image.Image):
        source = RawImage.from_pil(source)
    hasher = xxhash.xxh3_128()
    hasher.update(settings.digest)
    if isinstance(source, RawImage):
        palette = source.palette or b""
        header = (source.mode, source.size, source.palette_mode, len(palette), source.transparency)
        hasher.update(b"raw\0" + repr(header).encode() + b"\0")
        hasher.update(palette)
        hasher.update(source.pixels)
    else:
        hasher.update(b"encoded\0")
        hasher.update(source)
    return hasher.hexdigest()


def pixels_digest(pixels: np.ndarray) -> int:
    """xxh3-64 of the array's bytes in C order: what a `ShmHandle` reader checks its copy
    against (EngineCore computes the same function; the two must stay the same)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(pixels).data)
