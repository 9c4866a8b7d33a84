"""Video-processor settings: every knob that changes a video's `pixel_values`, how frames are
sampled by default, and the limits that refuse video bombs from the container header."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from preprocess.settings import FAMILIES, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

# Containers a client may send (PyAV format names): mp4/mov, webm/mkv, gif.
DEFAULT_CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "gif")
DEFAULT_MAX_VIDEO_FRAMES = 7200  # 4 minutes at 30 frames per second
DEFAULT_MAX_FRAME_PIXELS = 3840 * 2160
DEFAULT_MAX_DECODED_PIXELS = 2_000_000_000  # frames × pixels decoded to reach the sampled frames


@dataclass(frozen=True)
class VideoSettings:
    """The Qwen video processors (transformers' `Qwen2VLVideoProcessor` and
    `Qwen3VLVideoProcessor`). For Qwen2-VL / Qwen2.5-VL `min_pixels`/`max_pixels` bound each
    frame; for Qwen3-VL they bound the whole clip (frames × pixels).

    Fields up to `rescale_factor` change the output and are covered by `digest`; the sampling
    defaults change which frames are taken and are hashed with the request's sampling; the
    limits only decide what is refused."""

    family: str = "qwen2_vl"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    default_num_frames: int | None = None  # None and no default_fps: 32 frames
    default_fps: float | None = None
    max_frames: int = 768
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_frame_pixels: int = DEFAULT_MAX_FRAME_PIXELS
    max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS
    containers: tuple[str, ...] = DEFAULT_CONTAINERS

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels ({self.max_pixels}) must be >= min_pixels ({self.min_pixels})")
        if any(s == 0 for s in self.image_std):
            raise ValueError("image_std must not contain 0")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @functools.cached_property
    def digest(self) -> bytes:
        key = (
            "video",
            self.family,
            self.patch_size,
            self.merge_size,
            self.temporal_patch_size,
            self.min_pixels,
            self.max_pixels,
            tuple(float(v) for v in self.image_mean),
            tuple(float(v) for v in self.image_std),
            float(self.rescale_factor),
        )
        return xxhash.xxh3_128_digest(repr(key).encode())

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], family: str, **limits: Any) -> VideoSettings:
        """Build from a `video_preprocessor_config.json` dict, resolving keys as transformers
        does (top-level `min_pixels`/`max_pixels` override `size`). Raises ValueError for
        configs that switch off a step this package always performs."""
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag, True) is not True:
                raise ValueError(f"unsupported video processor config: {flag}={config[flag]!r}")
        if config.get("resample", 3) != 3:
            raise ValueError(f"unsupported video processor config: resample={config['resample']!r} (need 3)")
        if config.get("cap_pixels_per_frame"):
            raise ValueError("unsupported video processor config: cap_pixels_per_frame=true")
        defaults = _family_defaults(family)
        size = config.get("size") or {}
        sampling = config.get("do_sample_frames", family == "qwen3_vl")
        return cls(
            family=family,
            patch_size=int(config.get("patch_size", defaults["patch_size"])),
            merge_size=int(config.get("merge_size", 2)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge", defaults["min_pixels"])),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge", defaults["max_pixels"])),
            image_mean=tuple(float(v) for v in config.get("image_mean", defaults["mean"])),
            image_std=tuple(float(v) for v in config.get("image_std", defaults["std"])),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            default_num_frames=config.get("num_frames") if sampling else None,
            default_fps=config.get("fps", defaults["fps"]) if sampling else None,
            max_frames=int(config.get("max_frames", 768)),
            **limits,
        )


def _family_defaults(family: str) -> dict[str, Any]:
    """transformers' class defaults of each family's video processor."""
    if family == "qwen3_vl":
        half = (0.5, 0.5, 0.5)
        return {
            "patch_size": 16,
            "min_pixels": 128 * 32 * 32,
            "max_pixels": 32 * 32 * 768,
            "mean": half,
            "std": half,
            "fps": 2,
        }
    return {
        "patch_size": 14,
        "min_pixels": 128 * 28 * 28,
        "max_pixels": 28 * 28 * 768,
        "mean": OPENAI_CLIP_MEAN,
        "std": OPENAI_CLIP_STD,
        "fps": None,
    }
