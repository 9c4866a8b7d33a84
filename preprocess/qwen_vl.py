"""The Qwen-VL image transform: smart-resize, bicubic resize, normalise and patchify.

The result equals transformers' `Qwen2VLImageProcessorPil` (which Qwen2-VL, Qwen2.5-VL and
Qwen3-VL all use for images) bit for bit, but for the frame being written once rather than
repeated over T (`QwenVLImageSettings.frame_dim`): the resize computes Pillow's integers (see
`preprocess.resample`), and rescale+normalise is checked exhaustively against transformers'
arithmetic (see `preprocess.normalise`), so no rounding differs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from PIL import Image

from preprocess.errors import EmptyImage, ExtremeAspectRatio
from preprocess.patchify import patchify_into
from preprocess.resample import resize_image
from preprocess.transform import DEFAULT_FORMATS, DEFAULT_MAX_IMAGE_PIXELS, Allocate, GridTHW, ImageTransform

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
_BICUBIC = 3  # transformers' `resample=3`; the only filter implemented here


@dataclass(frozen=True)
class QwenVLImageSettings(ImageTransform):
    """`Qwen2VLImageProcessor` settings (defaults: transformers' class defaults).

    Fields up to `rescale_factor` change the output and are covered by `digest`;
    `max_image_pixels` and `formats` only decide what is refused and are not.
    """

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
        """Width of one row of an image's pixels as this transform writes them: C·P·P, the frame
        once. transformers repeats a still image's frame over T; the model does that on arrival
        (`mmserve.layers.packed_weights.PatchProjection`), so half the bytes travel."""
        return 3 * self.patch_size * self.patch_size

    @functools.cached_property
    def digest(self) -> bytes:
        key = (
            "qwen_vl",
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
    def from_hf_config(cls, config: Mapping[str, Any], **limits: Any) -> QwenVLImageSettings:
        """Build from a `preprocessor_config.json` dict, resolving keys as transformers does.

        Top-level `min_pixels`/`max_pixels` override `size.shortest_edge`/`size.longest_edge`.
        `limits` sets the non-hashed fields (`max_image_pixels`, `formats`). Raises ValueError
        for configs that switch off a step this transform always performs.
        """
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag, True) is not True:
                raise ValueError(f"unsupported preprocessor config: {flag}={config[flag]!r}")
        if config.get("resample", _BICUBIC) != _BICUBIC:
            raise ValueError(f"unsupported preprocessor config: resample={config['resample']!r} (need 3)")
        defaults = cls()
        size = config.get("size") or {}
        min_pixels = size.get("shortest_edge", size.get("min_pixels", defaults.min_pixels))
        max_pixels = size.get("longest_edge", size.get("max_pixels", defaults.max_pixels))
        return cls(
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

    def check_size(self, width: int, height: int) -> None:
        super().check_size(width, height)
        check_aspect_ratio(height, width)

    def grid(self, height: int, width: int) -> GridTHW:
        """`image_grid_thw` of an image of this (oriented) size: (1, grid_h, grid_w) in patches."""
        resized_h, resized_w = smart_resize(height, width, self)
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def num_tokens(self, grid: GridTHW) -> int:
        """merge_size² patches per token."""
        return grid[0] * grid[1] * grid[2] // self.merge_size**2

    def pixel_values_shape(self, grid: GridTHW) -> tuple[int, int]:
        """[grid_t·grid_h·grid_w, C·P·P]: transformers' `pixel_values` with the frame once."""
        return grid[0] * grid[1] * grid[2], self.frame_dim

    def process(self, rgb: Image.Image, allocate: Allocate) -> GridTHW:
        """Resize, normalise and patchify into a float32 array obtained from `allocate(shape)`."""
        resized = resize_rgb(rgb, self)
        grid = self.grid(rgb.height, rgb.width)
        out = allocate(self.pixel_values_shape(grid))
        patchify_into(resized, self, out)
        return grid


def check_aspect_ratio(height: int, width: int) -> None:
    """Refuse what smart-resize refuses (and zero sides, where it would divide by zero)."""
    if height == 0 or width == 0:
        raise EmptyImage(f"image has zero size ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ExtremeAspectRatio(
            f"image is {width}x{height}: aspect ratio {ratio:.1f} exceeds the limit of {MAX_ASPECT_RATIO}"
        )


def smart_resize(height: int, width: int, settings: QwenVLImageSettings) -> tuple[int, int]:
    """Target (height, width): multiples of `settings.factor`, area within [min, max]_pixels,
    aspect ratio kept as closely as possible. Same arithmetic as transformers (including
    Python's round-half-to-even), so the same sizes come out."""
    check_aspect_ratio(height, width)
    factor = settings.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > settings.max_pixels:
        beta = math.sqrt(height * width / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_rgb(image: Image.Image, settings: QwenVLImageSettings) -> np.ndarray:
    """[H, W, 3] uint8 pixels of `image` bicubic-resized to the smart-resize size, equal to
    Pillow's `Image.resize` (what transformers calls)."""
    height, width = smart_resize(image.height, image.width, settings)
    if (width, height) == image.size:
        return np.asarray(image)  # Pillow would return a copy; the pixels are the same
    return resize_image(image, height, width)
