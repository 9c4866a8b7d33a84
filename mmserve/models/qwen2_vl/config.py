"""The Qwen-VL configuration: the fields Qwen2-VL, Qwen2.5-VL and Qwen3-VL add to ModelConfig
(their language models and vision towers are close cousins), read from config.json and the
folder's processor files. Imports no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmserve.model_config import ModelConfig


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen-VL model."""

    depth: int
    dim: int  # width of the vision transformer (Qwen2-VL `embed_dim`, Qwen2.5-VL `hidden_size`)
    num_heads: int
    mlp_dim: int
    out_dim: int  # width of the merged tokens = the language model's hidden size
    hidden_act: str
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    in_channels: int = 3
    rope_theta: float = 10000.0
    window_size: int = 0  # Qwen2.5-VL window attention (pixels); 0 = none
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float = 0.0  # Qwen2.5-VL: temporal position units per second of video
    num_position_embeddings: int = 0  # Qwen3-VL: learned position table (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose features feed the LM

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


@dataclass(frozen=True, kw_only=True)
class QwenVLConfig(ModelConfig):
    """A Qwen-VL checkpoint: the generic fields, and those of its language model and tower."""

    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool = False  # Qwen3-VL interleaves the t/h/w rotary channels
    qkv_bias: bool = True  # Qwen2 has q/k/v biases; Qwen3 has none (and q/k norms instead)
    image_token_id: int
    video_token_id: int = -1
    vision_start_token_id: int
    vision_end_token_id: int
    vision: VisionConfig

    def split_widths(self, split_encoder: bool) -> dict[str, int]:
        widths = {**super().split_widths(split_encoder), "intermediate_size": self.intermediate_size}
        if split_encoder:
            vision = self.vision
            widths |= {
                "vision num_heads": vision.num_heads,
                "vision MLP width": vision.mlp_dim,
                "vision merger width": vision.dim * vision.spatial_merge_size**2,
            }
        return widths


def processor_file(path: Path, name: str) -> dict[str, Any]:
    """A processor config of the folder (`{}` where it has none)."""
    file = path / name
    return json.loads(file.read_text()) if file.is_file() else {}


def image_processor_file(path: Path) -> dict[str, Any]:
    """preprocessor_config.json, which every Qwen-VL folder has (FileNotFoundError if not)."""
    file = path / "preprocessor_config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no preprocessor_config.json")
    return json.loads(file.read_text())


def video_processor_file(path: Path) -> dict[str, Any]:
    """The video processor's config: video_preprocessor_config.json, else
    preprocessor_config.json, as transformers falls back."""
    return processor_file(path, "video_preprocessor_config.json") or image_processor_file(path)


def pixel_bounds(
    processor: dict[str, Any], vision: dict[str, Any], default_max_pixels: int
) -> tuple[int, int]:
    """(max_pixels, factor) a processor config gives, where factor = patch · merge: a resized
    side is a multiple of factor, and one merged token covers factor × factor pixels."""
    max_pixels = processor.get("max_pixels") or processor.get("size", {}).get("longest_edge")
    factor = int(processor.get("patch_size", vision.get("patch_size", 14))) * int(
        processor.get("merge_size", vision.get("spatial_merge_size", 2))
    )
    return int(max_pixels or default_max_pixels), factor
