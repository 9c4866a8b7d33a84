"""Qwen2-VL as a model family: its config, processor, positions and modules (`FAMILY`).

Qwen2.5-VL and Qwen3-VL extend this family in their own folders (each overrides what differs:
its vision config, its head sizes, its video layout, its modules). Imports no torch.
"""

from __future__ import annotations

from typing import Any

from mmserve.model_config import full_attention_layers
from mmserve.model_folder import text_fields
from mmserve.models.family import FolderConfig, ModelFamily, TextTokens
from mmserve.models.qwen2_vl.config import (
    QwenVLConfig,
    VisionConfig,
    image_processor_file,
    pixel_bounds,
    processor_file,
)
from mmserve.models.qwen2_vl.positions import MRopePositions
from mmserve.models.qwen2_vl.processing import QwenVLProcessor

MAX_VIDEO_FRAMES = 768  # the Qwen video processors' `max_frames`


class Qwen2VLFamily(ModelFamily):
    name = "qwen2_vl"
    architectures = ("Qwen2VLForConditionalGeneration",)
    processor_kwargs = ("min_pixels", "max_pixels")
    processor_class: type[QwenVLProcessor] = QwenVLProcessor

    def model_config(self, folder: FolderConfig) -> QwenVLConfig:
        raw, text = folder.raw, text_fields(folder.raw)
        rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
        hidden_size, num_heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
        head_dim = self.head_dim(text, hidden_size, num_heads)
        num_layers = int(text["num_hidden_layers"])
        images = image_processor_file(folder.path) | folder.processor_kwargs
        max_pixels, factor = pixel_bounds(images, raw["vision_config"], 12845056)
        return QwenVLConfig(
            **folder.common_fields(self.name),
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            layers=full_attention_layers(num_layers, num_kv_heads, head_dim),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_image_tokens=max_pixels // (factor * factor),  # smart-resize keeps within max_pixels
            max_video_tokens=self.max_video_tokens(folder),
            position_rows=MRopePositions.rows,
            intermediate_size=int(text["intermediate_size"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
            mrope_section=tuple(rope.get("mrope_section", (16, 24, 24))),
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            qkv_bias=bool(text.get("attention_bias", self.default_qkv_bias)),
            image_token_id=int(raw["image_token_id"]),
            video_token_id=int(raw.get("video_token_id", -1)),
            vision_start_token_id=int(raw["vision_start_token_id"]),
            vision_end_token_id=int(raw["vision_end_token_id"]),
            vision=self.vision_config(raw["vision_config"], hidden_size),
        )

    default_qkv_bias = True  # Qwen2's q/k/v projections have biases

    def head_dim(self, text: dict[str, Any], hidden_size: int, num_heads: int) -> int:
        return hidden_size // num_heads

    def vision_config(self, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        dim = int(raw["embed_dim"])
        return VisionConfig(
            dim=dim,
            mlp_dim=int(dim * raw.get("mlp_ratio", 4)),
            out_dim=int(raw.get("hidden_size", text_hidden_size)),
            hidden_act=raw.get("hidden_act", "quick_gelu"),
            **common_vision_fields(raw),
        )

    def max_video_tokens(self, folder: FolderConfig) -> int:
        """Tokens of the largest video item: each frame is bounded by max_pixels, and a video
        is one item of up to MAX_VIDEO_FRAMES frames."""
        vision = folder.raw["vision_config"]
        videos = processor_file(folder.path, "video_preprocessor_config.json")
        max_pixels, factor = pixel_bounds(videos, vision, 28 * 28 * 768)
        temporal = int(vision.get("temporal_patch_size", 2))
        return max_pixels // (factor * factor) * -(-MAX_VIDEO_FRAMES // temporal)

    def multimodal_processor(
        self, config: QwenVLConfig, tokens: TextTokens, processor_kwargs: dict[str, Any]
    ) -> QwenVLProcessor:
        return self.processor_class(config, tokens, processor_kwargs)

    def prompt_positions(self, config: QwenVLConfig) -> MRopePositions:
        return MRopePositions(config.vision.spatial_merge_size)

    def model_class(self) -> type:
        from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration


def common_vision_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The vision config's fields every Qwen-VL generation names alike."""
    return {
        "depth": int(raw["depth"]),
        "num_heads": int(raw["num_heads"]),
        "patch_size": int(raw.get("patch_size", raw.get("spatial_patch_size", 14))),
        "spatial_merge_size": int(raw.get("spatial_merge_size", 2)),
        "temporal_patch_size": int(raw.get("temporal_patch_size", 2)),
        "in_channels": int(raw.get("in_chans", raw.get("in_channels", 3))),
    }


FAMILY = Qwen2VLFamily()
