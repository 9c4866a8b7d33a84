"""What a Hugging Face model folder's side files say that the model config needs: the largest
image and video items the processors can produce, and the EOS ids of generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path


def _processor_limits(path: Path, vision: dict, name: str, default_max_pixels: int) -> tuple[int, int]:
    """(max_pixels, factor) of the processor config file `name`, where factor = patch · merge."""
    processor_file = path / name
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    max_pixels = processor.get("max_pixels") or processor.get("size", {}).get("longest_edge")
    factor = int(processor.get("patch_size", vision.get("patch_size", 14))) * int(
        processor.get("merge_size", vision.get("spatial_merge_size", 2))
    )
    return int(max_pixels or default_max_pixels), factor


def max_image_tokens(path: Path, vision: dict) -> int:
    """max_pixels / (patch · merge)²: smart-resize keeps every image within max_pixels."""
    max_pixels, factor = _processor_limits(path, vision, "preprocessor_config.json", 12845056)
    return max_pixels // (factor * factor)


MAX_VIDEO_FRAMES = 768  # the Qwen video processors' `max_frames`


def max_video_tokens(path: Path, family: str, vision: dict) -> int:
    """Tokens of the largest video item. Qwen2-VL / Qwen2.5-VL bound each frame by max_pixels and a
    video is one item of up to MAX_VIDEO_FRAMES frames; Qwen3-VL bounds the whole clip by
    max_pixels and each pair of frames is an item of its own (timestamps separate them)."""
    max_pixels, factor = _processor_limits(path, vision, "video_preprocessor_config.json", 28 * 28 * 768)
    temporal = int(vision.get("temporal_patch_size", 2))
    if family == "qwen3_vl":
        return max_pixels // (temporal * factor * factor)
    return max_pixels // (factor * factor) * -(-MAX_VIDEO_FRAMES // temporal)


def eos_ids(path: Path, text: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several), else config.json."""
    generation_file = path / "generation_config.json"
    eos = json.loads(generation_file.read_text()).get("eos_token_id") if generation_file.is_file() else None
    if eos is None:
        eos = text.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
