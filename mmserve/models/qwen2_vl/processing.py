"""How Qwen-VL prompts carry images and videos: the Qwen-VL transforms of preprocess/ with the
folder's settings, and the placeholder runs the chat template's pads become.

The template writes `<|vision_start|><|image_pad|><|vision_end|>` for an image and the same
with `<|video_pad|>` for a video; each pad becomes its item's run of pads (one per merged
token), one feature. Qwen2.5-VL spaces a video's temporal positions by its frame rate
(`position_step`); Qwen3-VL lays a video out frame pair by frame pair (qwen3_vl/processing.py).
Imports no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmserve.models.family import Expansion, MultiModalProcessor, Placement, ProcessedItem, TextTokens
from mmserve.models.qwen2_vl.config import QwenVLConfig, image_processor_file, video_processor_file
from preprocess.qwen_vl import QwenVLImageSettings
from preprocess.qwen_vl_video import QwenVLVideoSettings

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
ASSUMED_FPS = 24.0  # what transformers assumes for frames given without a rate


class QwenVLProcessor(MultiModalProcessor):
    clip_bound_video = False  # the video processor bounds each frame's pixels (Qwen2-VL's)

    def __init__(self, config: QwenVLConfig, tokens: TextTokens, processor_kwargs: dict[str, Any]) -> None:
        """`processor_kwargs` (--mm-processor-kwargs: min_pixels / max_pixels) override the
        image processor's settings, and so enter every image's hash."""
        self.config = config
        self.tokens = tokens
        self.image_settings = QwenVLImageSettings.from_hf_config(
            image_processor_file(config.path) | processor_kwargs
        )
        self.video_settings = QwenVLVideoSettings.from_hf_config(
            video_processor_file(config.path), clip_bound=self.clip_bound_video
        )
        self.image_placeholder, self.image_placeholder_id = IMAGE_PAD, tokens.token_to_id(IMAGE_PAD)
        self.video_placeholder, self.video_placeholder_id = VIDEO_PAD, tokens.token_to_id(VIDEO_PAD)

    def expand_image(self, item: ProcessedItem) -> Expansion:
        return Expansion(
            [self.image_placeholder_id] * item.num_tokens, [Placement(0, item.num_tokens, item.grid_thw)]
        )

    def expand_video(self, item: ProcessedItem) -> Expansion:
        placement = Placement(0, item.num_tokens, item.grid_thw, position_step=self.video_position_step(item))
        return Expansion([self.video_placeholder_id] * item.num_tokens, [placement])

    def video_position_step(self, item: ProcessedItem) -> float:
        """Temporal position units per temporal patch: tokens_per_second × seconds per patch,
        rounded through float32 as transformers' tensors are (Qwen2.5-VL); 1 where the model
        has no rate (Qwen2-VL)."""
        seconds = self.video_settings.temporal_patch_size / sampled_fps(item)
        return position_step(self.config.vision.tokens_per_second, seconds)


def position_step(tokens_per_second: float, seconds_per_temporal_patch: float) -> float:
    """tokens_per_second × seconds per temporal patch in float32, as transformers' tensors
    compute it; 1 for a model without a rate (tokens_per_second 0)."""
    if not tokens_per_second:
        return 1.0
    return float(np.float32(tokens_per_second) * np.float32(seconds_per_temporal_patch))


def sampled_fps(item: ProcessedItem) -> float:
    """Frames per second of the sampled frames (transformers' `VideoMetadata.sampled_fps`)."""
    info = item.video_info
    if info.fps is None:
        return ASSUMED_FPS
    return len(info.frames_indices) / info.total_num_frames * info.fps
