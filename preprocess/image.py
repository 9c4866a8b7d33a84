"""Pure transforms: smart-resize geometry, bicubic resize, normalise and patchify.

The result equals transformers' `Qwen2VLImageProcessorPil` bit for bit, but for the frame being
written once rather than repeated over T (`ProcessorSettings.frame_dim`): the resize computes
Pillow's integers (see `preprocess.resample`), and rescale+normalise is checked exhaustively
against transformers' arithmetic (see `preprocess.normalise`), so no rounding differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from PIL import Image

from preprocess.errors import EmptyImage, ExtremeAspectRatio
from preprocess.patchify import patchify_into
from preprocess.resample import resize_image
from preprocess.settings import ProcessorSettings

GridTHW = tuple[int, int, int]
MAX_ASPECT_RATIO = 200


def check_aspect_ratio(height: int, width: int) -> None:
    """Refuse what smart-resize refuses (and zero sides, where it would divide by zero)."""
    if height == 0 or width == 0:
        raise EmptyImage(f"image has zero size ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ExtremeAspectRatio(
            f"image is {width}x{height}: aspect ratio {ratio:.1f} exceeds the limit of {MAX_ASPECT_RATIO}"
        )


def smart_resize(height: int, width: int, settings: ProcessorSettings) -> tuple[int, int]:
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


def grid_thw(height: int, width: int, settings: ProcessorSettings) -> GridTHW:
    """`image_grid_thw` of an image of this (oriented) size: (1, grid_h, grid_w) in patches."""
    resized_h, resized_w = smart_resize(height, width, settings)
    return 1, resized_h // settings.patch_size, resized_w // settings.patch_size


def num_tokens(grid: GridTHW, settings: ProcessorSettings) -> int:
    """Placeholder tokens the LM sees for this grid (merge_size² patches per token)."""
    return grid[0] * grid[1] * grid[2] // settings.merge_size**2


def pixel_values_shape(grid: GridTHW, settings: ProcessorSettings) -> tuple[int, int]:
    """An image's pixels are [grid_t·grid_h·grid_w, C·P·P] float32: transformers'
    `pixel_values` with the frame once, not repeated over T (`ProcessorSettings.frame_dim`)."""
    return grid[0] * grid[1] * grid[2], settings.frame_dim


def resize_rgb(image: Image.Image, settings: ProcessorSettings) -> np.ndarray:
    """[H, W, 3] uint8 pixels of `image` bicubic-resized to the smart-resize size, equal to
    Pillow's `Image.resize` (what transformers calls)."""
    height, width = smart_resize(image.height, image.width, settings)
    if (width, height) == image.size:
        return np.asarray(image)  # Pillow would return a copy; the pixels are the same
    return resize_image(image, height, width)


def process_rgb(
    rgb_image: Image.Image,
    settings: ProcessorSettings,
    allocate: Callable[[tuple[int, int]], np.ndarray],
) -> GridTHW:
    """Resize, normalise and patchify into a float32 array obtained from `allocate(shape)`
    (`pixel_values_shape`: the frame once)."""
    resized = resize_rgb(rgb_image, settings)
    grid = grid_thw(rgb_image.height, rgb_image.width, settings)
    out = allocate(pixel_values_shape(grid, settings))
    patchify_into(resized, settings, out)
    return grid
