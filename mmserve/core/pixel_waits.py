"""Requests waiting for the pixels of an image sent by hash.

The frontend sends an image the engine held by its hash alone (`MultiModalFeature.by_hash`), and
the engine drops an image's pixels once it has encoded it. Either way, when a request reaches
such an image and its embeddings are no longer in the encoder cache, its span stops before the
image (span_plan.py) and it is asked for here, once per (request, image), until the frontend's
answer arrives (`supply`) or the request finishes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from mmserve.core.request import Request
    from mmserve.core.sched_output import SchedulerOutput


class PixelWaits:
    def __init__(self) -> None:
        self.needed: list[tuple[str, str]] = []  # (request id, mm_hash) to ask for, in order
        self._asked: dict[str, set[str]] = {}  # request id → hashes asked for and not received

    def ask(self, request: Request, feature_indices: list[int]) -> None:
        for index in feature_indices:
            mm_hash = request.mm_features[index].mm_hash
            asked = self._asked.setdefault(request.request_id, set())
            if mm_hash not in asked:
                asked.add(mm_hash)
                self.needed.append((request.request_id, mm_hash))

    def ask_again(self, request_id: str, mm_hash: str) -> None:
        """The answer to an ask could not be used (its pixel handle was unreadable): ask once
        more, if the request still waits for that image."""
        if mm_hash in self._asked.get(request_id, ()):
            self.needed.append((request_id, mm_hash))

    def supply(self, request: Request, mm_hash: str, pixel_values: np.ndarray) -> None:
        """Give the request's features with `mm_hash` their pixels. ValueError if they do not
        match the image's grid (then nothing is changed)."""
        features = [f for f in request.mm_features if f.mm_hash == mm_hash]
        for f in features:
            t, h, w = f.grid_thw
            if pixel_values.ndim != 2 or pixel_values.shape[0] != t * h * w:
                raise ValueError(f"pixels of shape {pixel_values.shape} do not match grid {f.grid_thw}")
        for f in features:
            f.pixel_values = pixel_values
        self._asked.get(request.request_id, set()).discard(mm_hash)

    def take_needed(self) -> list[tuple[str, str]]:
        needed, self.needed = self.needed, []
        return needed

    def forget(self, request_id: str) -> None:
        """The request finished; asks still unsent for it are dropped too."""
        if self._asked.pop(request_id, None):
            self.needed = [(r, h) for r, h in self.needed if r != request_id]

    def num_waiting(self) -> int:
        """Requests with an ask not answered yet."""
        return sum(bool(asked) for asked in self._asked.values())


def drop_encoded_pixels(requests: dict[str, Request], scheduler_output: SchedulerOutput) -> None:
    """Images encoded by `scheduler_output` need no pixels in the engine any more: the frontend
    keeps their sources and sends them again should the embeddings be evicted before the request
    is past them. (Video items keep theirs: one is a slice of a whole clip.)"""
    for request_id, indices in scheduler_output.scheduled_encoder_inputs.items():
        request = requests.get(request_id)
        if request is None:
            continue
        encoded = {request.mm_features[index].mm_hash for index in indices}
        for f in request.mm_features:
            if f.mm_hash in encoded and f.modality == "image" and f.pixel_values is not None:
                f.pixel_values = None
                f.by_hash = True
