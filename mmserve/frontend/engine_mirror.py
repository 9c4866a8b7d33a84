"""The frontend's mirror of EngineCore's encoder cache, and the pixels it keeps for the engine.

`EngineMirror` knows, for each image hash, its patch grid and token count (learned when the
pool first processed it) and whether the engine's encoder cache holds its embeddings (from the
`encoder_cache_changes` every EngineCoreOutputs carries, applied in order). An image the engine
holds is sent by hash alone: it costs the frontend no decode, no preprocessing and no pixel copy.

The mirror lags the engine by the outputs in flight, so it can be wrong in one direction: the
engine may have evicted an image the mirror still lists. That is safe: the engine asks for the
pixels (`pixels_needed`) and the request waits for them. `PixelSources` keeps, for every request
in flight, where each of its images' bytes are, to answer those asks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

ImageSource = bytes | Image.Image | Callable[[], bytes]  # bytes, a PIL image, or a reader of them


@dataclass(frozen=True)
class ImageShape:
    grid_thw: tuple[int, int, int]
    num_tokens: int


@dataclass(frozen=True)
class ByHashImage:
    """An image sent by hash: what `expand_placeholders` reads of a ProcessedImage, no pixels."""

    mm_hash: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    pixel_values: None = None
    video_info: None = None

    def release(self) -> None:
        """Nothing to release: no shared memory is held."""


class EngineMirror:
    """Thread-safe; `max_shapes` bounds the hashes whose shapes are remembered (LRU)."""

    def __init__(self, max_shapes: int = 65536) -> None:
        self.max_shapes = max_shapes
        self._shapes: OrderedDict[str, ImageShape] = OrderedDict()
        self._in_engine: set[str] = set()
        self._lock = threading.Lock()
        self.images_by_hash = 0  # images sent without pixels
        self.images_by_handle = 0  # images sent by shared-memory handle: no pixel copy here
        self.images_with_pixels = 0  # images sent with their pixels (copied into the message)
        self.pixels_resent = 0  # pixels sent because the engine asked (evicted meanwhile)
        self.pixels_resent_copied = 0  # ... of those, copied into the message, not by handle

    def learn(self, mm_hash: str, grid_thw: tuple[int, int, int], num_tokens: int) -> None:
        """The shape of an image the pool processed."""
        with self._lock:
            self._shapes[mm_hash] = ImageShape(tuple(grid_thw), num_tokens)
            self._shapes.move_to_end(mm_hash)
            while len(self._shapes) > self.max_shapes:
                self._shapes.popitem(last=False)

    def apply(self, changes: dict[str, bool]) -> None:
        """The engine's encoder-cache changes, as one EngineCoreOutputs reports them."""
        if not changes:
            return
        with self._lock:
            for mm_hash, cached in changes.items():
                if cached:
                    self._in_engine.add(mm_hash)
                else:
                    self._in_engine.discard(mm_hash)

    def by_hash(self, mm_hash: str) -> ByHashImage | None:
        """The image as sent by hash, if the engine (as last heard) holds it and its shape is known."""
        with self._lock:
            shape = self._shapes.get(mm_hash) if mm_hash in self._in_engine else None
        if shape is None:
            return None
        return ByHashImage(mm_hash, shape.grid_thw, shape.num_tokens)

    def reset(self) -> None:
        """The engine restarted: it holds nothing."""
        with self._lock:
            self._in_engine.clear()

    def num_in_engine(self) -> int:
        return len(self._in_engine)


class PixelSources:
    """Request id → {mm_hash: where its bytes are}, for the requests in flight, and which of
    their images the engine was sent pixels for already. Thread-safe."""

    def __init__(self) -> None:
        self._sources: dict[str, dict[str, ImageSource]] = {}
        self._answered: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def add(self, request_id: str, sources: dict[str, ImageSource]) -> None:
        if sources:
            with self._lock:
                self._sources[request_id] = sources

    def get(self, request_id: str, mm_hash: str) -> ImageSource | None:
        with self._lock:
            return self._sources.get(request_id, {}).get(mm_hash)

    def first_answer(self, request_id: str, mm_hash: str) -> bool:
        """Whether this is the first time the engine is answered with this image's pixels for
        this request (it asks again when a handle it was sent could not be read: then the pixels
        go as an array, so that a reader who cannot use handles is never asked forever)."""
        with self._lock:
            if request_id not in self._sources:
                return True  # finished: the engine drops whatever it is sent
            answered = self._answered.setdefault(request_id, set())
            first = mm_hash not in answered
            answered.add(mm_hash)
        return first

    def forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._sources.pop(request_id, None)
                self._answered.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sources)
