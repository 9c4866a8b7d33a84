"""Expanding a prompt's placeholder tokens into its items' tokens, and their features.

Each image placeholder the chat template rendered (or the user wrote) becomes what the model
family's processor lays out for that image, each video placeholder what it lays out for the
video (`MultiModalProcessor.expand_image` / `expand_video`); images and videos are matched to
their placeholders in prompt order, each modality on its own, as transformers' processors match
them.
"""

from __future__ import annotations

import numpy as np

from mmserve.frontend.pixel_store_mirror import ByHashImage
from mmserve.models.family import MultiModalProcessor
from mmserve.protocol import MultiModalFeature, PixelHandle
from preprocess import ProcessedImage


class PlaceholderMismatch(ValueError):
    """The prompt's placeholders do not match its images or videos (client-safe message)."""


def expand_placeholders(
    token_ids: list[int], processed: list[ProcessedImage | ByHashImage], processor: MultiModalProcessor
) -> tuple[list[int], list[MultiModalFeature], dict[str, np.ndarray]]:
    """`processed`: the prompt's images and videos (each modality in prompt order). Returns the
    expanded token ids, the features (no pixels: an image's stay in the pool's shared memory or,
    sent by hash, in the engine) and each video feature's pixels, copied out, by mm_hash.
    Releasing `processed` is the caller's."""
    images = [p for p in processed if p.video_info is None]
    clips = [p for p in processed if p.video_info is not None]
    image_id = processor.image_placeholder_id
    video_id = processor.video_placeholder_id if processor.video_placeholder_id is not None else -1
    _check_count(token_ids.count(image_id), len(images), processor.image_placeholder, "images")
    if clips or processor.video_placeholder is not None:
        _check_count(token_ids.count(video_id), len(clips), processor.video_placeholder, "videos")
    next_image, next_clip = iter(images), iter(clips)
    expanded: list[int] = []
    features: list[MultiModalFeature] = []
    arrays: dict[str, np.ndarray] = {}
    previous = 0
    for position, token in enumerate(token_ids):
        if token != image_id and token != video_id:
            continue
        expanded.extend(token_ids[previous:position])
        previous = position + 1
        is_video = token == video_id
        item = next(next_clip) if is_video else next(next_image)
        expansion = processor.expand_video(item) if is_video else processor.expand_image(item)
        for placement in expansion.placements:
            mm_hash = item.mm_hash if placement.part is None else f"{item.mm_hash}-{placement.part}"
            features.append(
                MultiModalFeature(
                    mm_hash,
                    len(expanded) + placement.offset,
                    placement.length,
                    placement.grid_thw,
                    modality="video" if is_video else "image",
                    position_step=placement.position_step,
                )
            )
            if is_video:  # out of shared memory: the pool's segment is let go
                start_row, stop_row = placement.rows or (0, len(item.pixel_values))
                arrays[mm_hash] = np.array(item.pixel_values[start_row:stop_row])
        expanded.extend(expansion.token_ids)
    expanded.extend(token_ids[previous:])
    return expanded, features, arrays


def pixel_handle(image: ProcessedImage, use_id: int) -> PixelHandle:
    """Where `image`'s pixels are, for EngineCore; `use_id` names the pool's pin for one send."""
    handle = image.handle
    return PixelHandle(handle.shm_name, tuple(handle.shape), handle.dtype, image.digest, use_id)


def _check_count(num_placeholders: int, num_items: int, placeholder: str | None, what: str) -> None:
    if num_placeholders != num_items:
        raise PlaceholderMismatch(
            f"the prompt has {num_placeholders} {placeholder} placeholders for {num_items} {what}"
        )
