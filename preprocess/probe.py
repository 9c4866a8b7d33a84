"""What an image will cost, from its header alone: no pixels are decoded.

The frontend uses this to build token ids (one placeholder run of `num_tokens` per image)
while the pool is still making the pixels. It agrees with full processing by construction:
same checks, same EXIF orientation, the same transform's geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from preprocess.decode import ImageSource, RawImage, open_encoded, oriented_size
from preprocess.transform import GridTHW, ImageTransform


@dataclass(frozen=True)
class ImageHeader:
    width: int  # after EXIF orientation, as the model will see it
    height: int
    grid_thw: GridTHW
    num_tokens: int


def probe(image: bytes | Image.Image, settings: ImageTransform) -> ImageHeader:
    """Size, grid and placeholder token count. Raises the same `ImageError`s processing would
    for anything visible in the header (format, size, pixel limit, the transform's limits)."""
    if isinstance(image, Image.Image):
        width, height = image.size
        settings.check_size(width, height)
    else:
        width, height = oriented_size(open_encoded(image, settings), image)
    grid = settings.grid(height, width)
    return ImageHeader(width, height, grid, settings.num_tokens(grid))


def pixel_values_nbytes(source: ImageSource, settings: ImageTransform) -> int:
    """Size of the `pixel_values` `source` will produce, from the header. EXIF orientation is
    not needed: a transform's rows are the same for a size and its transpose."""
    if isinstance(source, RawImage):
        width, height = source.size
        settings.check_size(width, height)
    else:
        width, height = open_encoded(source, settings).size
    rows, columns = settings.pixel_values_shape(settings.grid(height, width))
    return rows * columns * 4  # float32
