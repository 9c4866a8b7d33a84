"""Qwen3-VL (dense) as a model family: Qwen2-VL's (`qwen2_vl/family.py`) with Qwen3's language
model (explicit head_dim, no q/k/v biases), its own vision config, clip-bounded videos laid out
with timestamps (processing.py) and its modules. Imports no torch."""

from __future__ import annotations

from typing import Any

from mmserve.models.family import FolderConfig
from mmserve.models.qwen2_vl.config import VisionConfig, pixel_bounds, processor_file
from mmserve.models.qwen2_vl.family import Qwen2VLFamily, common_vision_fields
from mmserve.models.qwen3_vl.processing import Qwen3VLProcessor


class Qwen3VLFamily(Qwen2VLFamily):
    name = "qwen3_vl"
    architectures = ("Qwen3VLForConditionalGeneration",)
    processor_class = Qwen3VLProcessor
    default_qkv_bias = False  # Qwen3 normalises q and k per head instead

    def head_dim(self, text: dict[str, Any], hidden_size: int, num_heads: int) -> int:
        return int(text.get("head_dim") or 0) or hidden_size // num_heads

    def vision_config(self, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        return VisionConfig(
            dim=int(raw["hidden_size"]),
            mlp_dim=int(raw["intermediate_size"]),
            out_dim=int(raw.get("out_hidden_size", text_hidden_size)),
            hidden_act=raw.get("hidden_act", "gelu_pytorch_tanh"),
            num_position_embeddings=int(raw.get("num_position_embeddings", 2304)),
            deepstack_visual_indexes=tuple(raw.get("deepstack_visual_indexes", (8, 16, 24))),
            **common_vision_fields(raw),
        )

    def max_video_tokens(self, folder: FolderConfig) -> int:
        """Tokens of the largest video item: max_pixels bounds the whole clip, and each pair of
        frames is an item of its own (timestamps separate them)."""
        vision = folder.raw["vision_config"]
        videos = processor_file(folder.path, "video_preprocessor_config.json")
        max_pixels, factor = pixel_bounds(videos, vision, 28 * 28 * 768)
        temporal = int(vision.get("temporal_patch_size", 2))
        return max_pixels // (temporal * factor * factor)

    def model_class(self) -> type:
        from mmserve.models.qwen3_vl.model import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration


FAMILY = Qwen3VLFamily()
