"""A prompt ready for the engine: token ids with each item's placeholders expanded, its items'
features, and what it holds of their pixels until it is sent (`MediaProcessor.engine_request`
makes its engine requests)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmserve.frontend.pixel_store_mirror import Holds
from mmserve.protocol import MultiModalFeature
from preprocess import ProcessedImage


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    features: list[MultiModalFeature]
    # mm_hash → the pool's image behind each image item not sent by hash, held until the prompt
    # is released, so that its segment is still there to pin (or copy) when it is sent
    shared: dict[str, ProcessedImage] = field(default_factory=dict)
    # mm_hash → a video item's pixels, copied out of the pool
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # the entries of the engine's pixel store that this prompt relies on (pixel_store_mirror.py)
    holds: Holds | None = None

    @classmethod
    def from_processed(
        cls,
        text: str | None,
        token_ids: list[int],
        features: list[MultiModalFeature],
        arrays: dict[str, np.ndarray],
        processed: list,
        holds: Holds | None,
    ) -> ProcessedPrompt:
        """The prompt, keeping the first of `processed`'s references to each image's segment
        (the others, and videos' whose pixels are in `arrays`, are released)."""
        shared: dict[str, ProcessedImage] = {}
        for item in processed:
            if isinstance(item, ProcessedImage) and item.video_info is None and item.mm_hash not in shared:
                shared[item.mm_hash] = item
            else:
                item.release()
        return cls(text, token_ids, features, shared, arrays, holds)

    def release(self) -> None:
        """The prompt has been sent (or is dropped): let the pool have its segments back (pins
        hold their own) and the mirror evict its entries. Idempotent."""
        for image in self.shared.values():
            image.release()
        if self.holds is not None:
            self.holds.release()
