"""What a transform is: the settings a model family hands the pool, and the transform they name.

An image transform turns a decoded RGB image into pixel rows for the model's encoder; a video
transform turns sampled RGB frames into them. Each is a frozen dataclass of its settings with
the transform's methods: the pool, its workers and its cache call these and nothing
family-specific, and `digest` (every field that changes the pixels) keys every cache, so two
settings that could give different pixels never share an entry. The transforms themselves live
in modules named for the processors they reproduce.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
from PIL import Image

from preprocess.errors import EmptyImage, ImageTooLarge

GridTHW = tuple[int, int, int]  # (temporal, rows, columns) of an item's patch grid
Allocate = Callable[[tuple[int, int]], np.ndarray]  # shape → the float32 array to write

# Formats a client may send. Pillow understands many more; each extra parser is attack surface.
DEFAULT_FORMATS = ("BMP", "GIF", "JPEG", "PNG", "TIFF", "WEBP")  # JPEG includes MPO (phone photos)
# 64 MP (8000×8000): 192 MiB of decoded RGB per worker at most.
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
# Containers a client may send (PyAV format names): mp4/mov, webm/mkv, gif.
DEFAULT_CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "gif")
DEFAULT_MAX_VIDEO_FRAMES = 7200  # 4 minutes at 30 frames per second
DEFAULT_MAX_FRAME_PIXELS = 3840 * 2160
DEFAULT_MAX_DECODED_PIXELS = 2_000_000_000  # frames × pixels decoded to reach the sampled frames


class ImageTransform(ABC):
    """Settings of an image transform, and the transform. Subclasses are frozen dataclasses
    whose fields include `max_image_pixels` and `formats` (what is refused, not hashed)."""

    max_image_pixels: int
    formats: tuple[str, ...]

    @property
    @abstractmethod
    def digest(self) -> bytes:
        """16 bytes that differ whenever a result-changing setting differs."""

    @abstractmethod
    def grid(self, height: int, width: int) -> GridTHW:
        """The patch grid of an image of this (oriented) size."""

    @abstractmethod
    def num_tokens(self, grid: GridTHW) -> int:
        """Placeholder tokens the language model sees for an item of this grid."""

    @abstractmethod
    def pixel_values_shape(self, grid: GridTHW) -> tuple[int, int]:
        """[rows, columns] float32 of the pixels written for this grid. The rows of a size and of
        its transpose are the same (the pool sizes a segment before EXIF orientation is read)."""

    @abstractmethod
    def process(self, rgb: Image.Image, allocate: Allocate) -> GridTHW:
        """Transform `rgb` into the array `allocate(pixel_values_shape(grid))` returns."""

    def check_size(self, width: int, height: int) -> None:
        """Refuse sizes no processing could handle; cheap, so it runs before any decoding."""
        if height == 0 or width == 0:
            raise EmptyImage(f"image has zero size ({width}x{height})")
        if width * height > self.max_image_pixels:
            raise ImageTooLarge(
                f"image is {width}x{height} = {width * height:,} pixels, "
                f"more than the limit of {self.max_image_pixels:,}"
            )


class VideoTransform(ABC):
    """Settings of a video transform, and the transform. Subclasses are frozen dataclasses whose
    fields include the frame sampling defaults (`default_num_frames`, `default_fps`,
    `max_frames`) and the limits that refuse video bombs from the container's header
    (`max_video_frames`, `max_frame_pixels`, `max_decoded_pixels`, `containers`)."""

    default_num_frames: int | None
    default_fps: float | None
    max_frames: int
    max_video_frames: int
    max_frame_pixels: int
    max_decoded_pixels: int
    containers: tuple[str, ...]

    @property
    @abstractmethod
    def digest(self) -> bytes:
        """16 bytes that differ whenever a result-changing setting differs."""

    @abstractmethod
    def grid(self, num_frames: int, height: int, width: int) -> GridTHW:
        """The patch grid of `num_frames` sampled frames of this size."""

    @abstractmethod
    def num_tokens(self, grid: GridTHW) -> int:
        """Placeholder tokens the language model sees for a video of this grid."""

    @abstractmethod
    def pixel_values_shape(self, grid: GridTHW) -> tuple[int, int]:
        """[rows, columns] float32 of the pixels written for this grid."""

    @abstractmethod
    def patchify(self, frames: np.ndarray, grid: GridTHW, out: np.ndarray) -> None:
        """frames [T, H, W, 3] uint8 → `out` (`pixel_values_shape(grid)` float32)."""
