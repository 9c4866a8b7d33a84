"""Processor settings: every knob that changes `pixel_values`, plus the safety limits."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# All three families ship `Qwen2VLImageProcessor` for images (Qwen3-VL with 16-pixel patches);
# the family still goes into the hash so that two models never share cached pixels by accident
# if their processors ever diverge (their video processors do).
_PROCESSOR_CLASS_TO_FAMILY = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
}

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Formats a client may send. Pillow understands many more; each extra parser is attack surface.
DEFAULT_FORMATS = ("BMP", "GIF", "JPEG", "PNG", "TIFF", "WEBP")  # JPEG includes MPO (phone photos)
# 64 MP (8000×8000): 192 MiB of decoded RGB per worker at most.
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
# transformers' `resample=3`; the only filter implemented here.
_BICUBIC = 3


@dataclass(frozen=True)
class ProcessorSettings:
    """Qwen2-VL image-processor settings (defaults: transformers' class defaults).

    Fields up to `rescale_factor` change the output and are covered by `digest`;
    `max_image_pixels` and `formats` only decide what is refused and are not.
    """

    family: str = "qwen2_vl"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    formats: tuple[str, ...] = DEFAULT_FORMATS

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels ({self.max_pixels}) must be >= min_pixels ({self.min_pixels})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std must have 3 values (RGB)")
        if any(s == 0 for s in self.image_std):
            raise ValueError("image_std must not contain 0")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged token covers factor×factor pixels)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Width of one row of transformers' `pixel_values`: C·T·P·P."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def frame_dim(self) -> int:
        """Width of one row of an image's pixels as this package writes them: C·P·P, the frame
        once. transformers repeats a still image's frame over T; the model does that on arrival
        (`mmserve.layers.packed_weights.PatchProjection`), so half the bytes travel."""
        return 3 * self.patch_size * self.patch_size

    @functools.cached_property
    def digest(self) -> bytes:
        """16 bytes that differ whenever a result-changing field differs."""
        key = (
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
    def from_hf_config(
        cls, config: Mapping[str, Any], family: str | None = None, **limits: Any
    ) -> ProcessorSettings:
        """Build from a `preprocessor_config.json` dict, resolving keys as transformers does.

        Top-level `min_pixels`/`max_pixels` override `size.shortest_edge`/`size.longest_edge`.
        `family` defaults to the one named by `processor_class`. `limits` sets the
        non-hashed fields (`max_image_pixels`, `formats`). Raises ValueError for configs that
        switch off a step this package always performs.
        """
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag, True) is not True:
                raise ValueError(f"unsupported preprocessor config: {flag}={config[flag]!r}")
        if config.get("resample", _BICUBIC) != _BICUBIC:
            raise ValueError(f"unsupported preprocessor config: resample={config['resample']!r} (need 3)")
        if family is None:
            processor_class = config.get("processor_class")
            if processor_class not in _PROCESSOR_CLASS_TO_FAMILY:
                raise ValueError(f"cannot tell the model family from processor_class={processor_class!r}")
            family = _PROCESSOR_CLASS_TO_FAMILY[processor_class]
        defaults = cls()
        size = config.get("size") or {}
        min_pixels = size.get("shortest_edge", size.get("min_pixels", defaults.min_pixels))
        max_pixels = size.get("longest_edge", size.get("max_pixels", defaults.max_pixels))
        return cls(
            family=family,
            patch_size=int(config.get("patch_size", defaults.patch_size)),
            merge_size=int(config.get("merge_size", defaults.merge_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", defaults.temporal_patch_size)),
            min_pixels=int(config.get("min_pixels", min_pixels)),
            max_pixels=int(config.get("max_pixels", max_pixels)),
            image_mean=tuple(float(v) for v in config.get("image_mean", defaults.image_mean)),
            image_std=tuple(float(v) for v in config.get("image_std", defaults.image_std)),
            rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)),
            **limits,
        )
