"""The Qwen-VL video transforms: transformers' `Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL)
and `Qwen3VLVideoProcessor` given the same frames.

The resize is the same antialiased bicubic on uint8 that torchvision's tensor path calls
(torch's own kernel), the normalisation is the same float32 arithmetic, and patches are laid out
as theirs, with the last frame repeated up to a whole temporal patch. For Qwen2-VL / Qwen2.5-VL
`min_pixels`/`max_pixels` bound each frame (smart-resize, as an image); for Qwen3-VL they bound
the whole clip (frames × pixels: `clip_bound`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from preprocess.errors import EmptyVideo
from preprocess.qwen_vl import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, check_aspect_ratio, smart_resize
from preprocess.transform import (
    DEFAULT_CONTAINERS,
    DEFAULT_MAX_DECODED_PIXELS,
    DEFAULT_MAX_FRAME_PIXELS,
    DEFAULT_MAX_VIDEO_FRAMES,
    GridTHW,
    VideoTransform,
)


@dataclass(frozen=True)
class QwenVLVideoSettings(VideoTransform):
    """Fields up to `rescale_factor` change the output and are covered by `digest`; the
    sampling defaults change which frames are taken and are hashed with the request's sampling;
    the limits only decide what is refused."""

    clip_bound: bool = False  # min/max_pixels bound the whole clip (Qwen3-VL), not each frame
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
            "qwen_vl_video",
            self.clip_bound,
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
        cls, config: Mapping[str, Any], clip_bound: bool, **limits: Any
    ) -> QwenVLVideoSettings:
        """Build from a `video_preprocessor_config.json` dict, resolving keys as transformers
        does (top-level `min_pixels`/`max_pixels` override `size`); `clip_bound` picks
        `Qwen3VLVideoProcessor`'s class defaults and rules, else `Qwen2VLVideoProcessor`'s.
        Raises ValueError for configs that switch off a step this transform always performs."""
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag, True) is not True:
                raise ValueError(f"unsupported video processor config: {flag}={config[flag]!r}")
        if config.get("resample", 3) != 3:
            raise ValueError(f"unsupported video processor config: resample={config['resample']!r} (need 3)")
        if config.get("cap_pixels_per_frame"):
            raise ValueError("unsupported video processor config: cap_pixels_per_frame=true")
        defaults = _CLIP_BOUND_DEFAULTS if clip_bound else _FRAME_BOUND_DEFAULTS
        size = config.get("size") or {}
        sampling = config.get("do_sample_frames", clip_bound)
        return cls(
            clip_bound=clip_bound,
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

    def resized_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Target (height, width) of every frame, as the video processor computes it."""
        if not self.clip_bound:
            return smart_resize(height, width, self)  # each frame on its own, like an image
        temporal = self.temporal_patch_size
        if num_frames < temporal:
            raise EmptyVideo(f"this model needs at least {temporal} video frames, got {num_frames}")
        factor = self.factor
        if height < factor or width < factor:  # frames smaller than one token are lifted to one
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        check_aspect_ratio(height, width)
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        t_bar = round(num_frames / temporal) * temporal
        if t_bar * h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(num_frames * height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif t_bar * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (num_frames * height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid(self, num_frames: int, height: int, width: int) -> GridTHW:
        """`video_grid_thw`: temporal patches (the last one padded) and the patch grid of a frame."""
        resized_h, resized_w = self.resized_size(num_frames, height, width)
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t, resized_h // self.patch_size, resized_w // self.patch_size

    def num_tokens(self, grid: GridTHW) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge_size**2

    def pixel_values_shape(self, grid: GridTHW) -> tuple[int, int]:
        return grid[0] * grid[1] * grid[2], self.patch_dim

    def patchify(self, frames: np.ndarray, grid: GridTHW, out: np.ndarray) -> None:
        """frames [T, H, W, 3] uint8 → `out` [grid_t·gh·gw, C·T·P·P] float32, rows in (t,
        block_h, block_w, merge_h, merge_w) order and columns in (C, T, P_h, P_w) order."""
        import torch  # only the video path needs torch, for the same resize kernel as torchvision

        grid_t, gh, gw = grid
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        frames = np.require(frames, requirements="W")  # torch wants writable memory (copies if not)
        video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
        if (video.shape[2], video.shape[3]) != (gh * p, gw * p):
            video = torch.nn.functional.interpolate(
                video, size=[gh * p, gw * p], mode="bicubic", align_corners=False, antialias=True
            )
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        video = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        if pad := grid_t * tp - video.shape[0]:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        # [grid_t, tp, C, gh/m, m, p, gw/m, m, p] → [grid_t, gh/m, gw/m, m, m, C, tp, p, p]
        patches = video.view(grid_t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        torch.from_numpy(out).view(grid_t, gh // m, gw // m, m, m, 3, tp, p, p).copy_(patches)


# transformers' class defaults of the two video processors
_FRAME_BOUND_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "min_pixels": 128 * 28 * 28,
    "max_pixels": 28 * 28 * 768,
    "mean": OPENAI_CLIP_MEAN,
    "std": OPENAI_CLIP_STD,
    "fps": None,
}
_CLIP_BOUND_DEFAULTS: dict[str, Any] = {
    "patch_size": 16,
    "min_pixels": 128 * 32 * 32,
    "max_pixels": 32 * 32 * 768,
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "fps": 2,
}
