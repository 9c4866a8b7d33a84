"""EngineCore's pixel store: mm_hash → an item's preprocessed pixels, whose contents the
frontend decides (frontend/pixel_store_mirror.py keeps the same keys).

Every request names what to drop (`EngineRequest.mm_evict`) and brings the pixels of its items
the store lacks (by shared-memory handle, read here once, or as arrays); the store applies
both on arrival, in message order, and nothing else changes it. So an item sent by hash is
always here, and a request takes references to all its items' pixels at once: a later eviction
never takes pixels from a request in flight, preempted or not.

A handle whose segment is gone, short or holds other pixels (its digest does not match) is kept
as an unreadable entry (None): a request needing it fails with `UnreadablePixels`, and the
frontend, told in `EngineCoreOutputs.unreadable_pixels`, evicts it with a later request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmserve.core.pixel_handles import read_pixels

if TYPE_CHECKING:
    import numpy as np

    from mmserve.protocol import EngineRequest, MultiModalFeature


class UnreadablePixels(ValueError):
    """An item's pixel handle could not be read: the request fails (never waits)."""


class MissingPixels(ValueError):
    """An item sent by hash that the store does not hold: the frontend and the store disagree,
    a bug: the request fails with an internal error."""


@dataclass
class Arrival:
    """What applying one request's changes reports to the frontend."""

    released_handles: list[int] = field(default_factory=list)  # use ids of the handles read
    unreadable: list[str] = field(default_factory=list)  # hashes whose handles could not be read


class PixelStore:
    def __init__(self) -> None:
        self._pixels: dict[str, np.ndarray | None] = {}  # None: its handle could not be read

    def apply(self, request: EngineRequest) -> Arrival:
        """Drop what the request evicts, then add the pixels it brings (each handle read once
        into the engine's own copy, then released)."""
        for mm_hash in request.mm_evict:
            self._pixels.pop(mm_hash, None)
        arrival = Arrival()
        for mm_hash, handle in request.mm_handles.items():
            pixels = read_pixels(handle)
            self._pixels[mm_hash] = pixels
            arrival.released_handles.append(handle.use_id)
            if pixels is None:
                arrival.unreadable.append(mm_hash)
        self._pixels.update(request.mm_arrays)
        return arrival

    def pixels_of(self, features: list[MultiModalFeature]) -> dict[str, np.ndarray]:
        """mm_hash → pixels for every item of a request; `UnreadablePixels` or `MissingPixels`
        if an item has none."""
        pixels = {}
        for f in features:
            if f.mm_hash not in self._pixels:
                raise MissingPixels(f"internal error: the engine has no pixels for {f.modality} {f.mm_hash}")
            item = self._pixels[f.mm_hash]
            if item is None:
                raise UnreadablePixels(
                    f"the pixels of {f.modality} {f.mm_hash} could not be read from shared memory "
                    "(the segment is gone or holds other pixels); send the request again"
                )
            pixels[f.mm_hash] = item
        return pixels

    def keys(self) -> set[str]:
        return set(self._pixels)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._pixels.values() if p is not None)

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._pixels

    def __len__(self) -> int:
        return len(self._pixels)
