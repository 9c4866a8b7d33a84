"""Expanding a prompt's placeholder tokens into its items' token runs, and their features.

Each `<|image_pad|>` becomes its image's run of pads, each `<|video_pad|>` what the family lays
out for a video (`VideoTokens.expand`); images and videos are matched to their pads in prompt
order, each modality on its own, as transformers' processors match them.
"""

from __future__ import annotations

import numpy as np

from mmserve.frontend.pixel_store_mirror import ByHashImage
from mmserve.frontend.video_inputs import VIDEO_PAD, VideoTokens
from mmserve.protocol import MultiModalFeature, PixelHandle
from preprocess import ProcessedImage

IMAGE_PAD = "<|image_pad|>"


class PlaceholderMismatch(ValueError):
    """The prompt's placeholders do not match its images or videos (client-safe message)."""


def expand_placeholders(
    token_ids: list[int],
    processed: list[ProcessedImage | ByHashImage],
    image_pad_id: int,
    videos: VideoTokens | None,
) -> tuple[list[int], list[MultiModalFeature], dict[str, np.ndarray]]:
    """`processed`: the prompt's images and videos (each modality in prompt order). Returns the
    expanded token ids, the features (no pixels: an image's stay in the pool's shared memory or,
    sent by hash, in the engine) and each video item's pixels, copied out, by mm_hash.
    Releasing `processed` is the caller's."""
    images = [p for p in processed if p.video_info is None]
    clips = [p for p in processed if p.video_info is not None]
    video_pad_id = videos.pad_id if videos is not None else -1
    _check_count(token_ids.count(image_pad_id), len(images), IMAGE_PAD, "images")
    _check_count(token_ids.count(video_pad_id) if clips or videos else 0, len(clips), VIDEO_PAD, "videos")
    next_image, next_clip = iter(images), iter(clips)
    expanded: list[int] = []
    features: list[MultiModalFeature] = []
    arrays: dict[str, np.ndarray] = {}
    previous = 0
    for position, token in enumerate(token_ids):
        if token != image_pad_id and token != video_pad_id:
            continue
        expanded.extend(token_ids[previous:position])
        previous = position + 1
        if token == image_pad_id:
            image = next(next_image)
            features.append(MultiModalFeature(image.mm_hash, len(expanded), image.num_tokens, image.grid_thw))
            expanded.extend([image_pad_id] * image.num_tokens)
        else:
            tokens, video_features, video_pixels = videos.expand(next(next_clip), len(expanded))
            features.extend(video_features)
            arrays.update(video_pixels)
            expanded.extend(tokens)
    expanded.extend(token_ids[previous:])
    return expanded, features, arrays


def pixel_handle(image: ProcessedImage, use_id: int) -> PixelHandle:
    """Where `image`'s pixels are, for EngineCore; `use_id` names the pool's pin for one send."""
    handle = image.handle
    return PixelHandle(handle.shm_name, tuple(handle.shape), handle.dtype, image.digest, use_id)


def _check_count(num_pads: int, num_items: int, pad: str, what: str) -> None:
    if num_pads != num_items:
        raise PlaceholderMismatch(f"the prompt has {num_pads} {pad} placeholders for {num_items} {what}")
