"""A prompt ready for the engine: token ids with each item's placeholders expanded, its items'
features, and what it holds of their pixels until it is sent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from mmserve.frontend.engine_mirror import ImageSource
from mmserve.frontend.placeholders import pixel_handle
from mmserve.protocol import EngineRequest, MultiModalFeature
from mmserve.sampling_params import SamplingParams
from preprocess import ProcessedImage

PinPixels = Callable[[ProcessedImage], int]  # PreprocessPool.pin: a use id for one send


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    features: list[MultiModalFeature]
    # mm_hash → where the image's bytes are, for as long as the request runs (see engine_mirror)
    sources: dict[str, ImageSource] = field(default_factory=dict)
    # mm_hash → the pool's image behind the features with a pixel handle, held until the prompt
    # has been sent (`release_shared`), so that its segment is still there to pin
    shared: dict[str, ProcessedImage] = field(default_factory=dict)

    def engine_request(
        self,
        request_id: str,
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        pin: PinPixels | None = None,
    ) -> EngineRequest:
        """The message that hands this prompt to EngineCore (one per sample when n > 1). An image
        in the pool's shared memory goes by handle, pinned by `pin` for this message alone, or,
        without `pin`, copied into it; one whose segment the prompt no longer holds goes by hash
        (the engine asks for its pixels should it need them)."""
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=self.token_ids,
            mm_features=[self._to_send(f, pin) for f in self.features],
            sampling_params=params,
            arrival_time=arrival_time,
            priority=priority,
        )

    def release_shared(self) -> None:
        """The prompt has been sent: let the pool have its segments back (pins hold their own)."""
        for image in self.shared.values():
            image.release()

    def _to_send(self, feature: MultiModalFeature, pin: PinPixels | None) -> MultiModalFeature:
        if feature.pixel_handle is None:
            return feature
        image = self.shared.get(feature.mm_hash)
        if image is None or image.released:
            return replace(feature, pixel_handle=None, by_hash=True)
        if pin is None:
            return replace(feature, pixel_handle=None, pixel_values=np.array(image.pixel_values))
        return replace(feature, pixel_handle=pixel_handle(image, pin(image)))
