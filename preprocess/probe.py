"""What an image will cost, from its header alone: no pixels are decoded.

The frontend uses this to build token ids (one placeholder run of `num_tokens` per image)
while the pool is still making the pixels. It agrees with full processing by construction:
same checks, same EXIF orientation, same smart-resize.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from preprocess.decode import ImageSource, RawImage, check_size, open_encoded, oriented_size
from preprocess.image import GridTHW, grid_thw, num_tokens, pixel_values_shape
from preprocess.settings import ProcessorSettings


@dataclass(frozen=True)
class ImageHeader:
    width: int  # after EXIF orientation, as the model will see it
    height: int
    grid_thw: GridTHW
    num_tokens: int


def probe(image: bytes | Image.Image, settings: ProcessorSettings) -> ImageHeader:
    """Size, grid and placeholder token count. Raises the same `ImageError`s processing would
    for anything visible in the header (format, size, pixel limit, aspect ratio)."""
    if isinstance(image, Image.Image):
        width, height = image.size
        check_size(width, height, settings)
    else:
        width, height = oriented_size(open_encoded(image, settings), image)
    grid = grid_thw(height, width, settings)
    return ImageHeader(width, height, grid, num_tokens(grid, settings))


def pixel_values_nbytes(source: ImageSource, settings: ProcessorSettings) -> int:
    """Size of the `pixel_values` `source` will produce, from the header. EXIF orientation is
    not needed: smart-resize is symmetric in height and width, so a swap keeps the area."""
    if isinstance(source, RawImage):
        width, height = source.size
        check_size(width, height, settings)
    else:
        width, height = open_encoded(source, settings).size
    rows, columns = pixel_values_shape(grid_thw(height, width, settings), settings)
    return rows * columns * 4  # float32
