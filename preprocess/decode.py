"""From client input to an RGB `PIL.Image`, exactly as transformers sees it.

Encoded bytes follow `transformers.image_utils.load_image` for orientation (EXIF transpose)
and transformers' image processors' `convert_to_rgb` for colour: anything with an alpha band or a
`transparency` entry is composited onto white, everything else goes through `convert("RGB")`.
Animated or multi-page images give their first frame. PIL inputs are taken as given, with no
EXIF transpose, as the processor does with a PIL image.

Every problem a client can cause comes out as an `ImageError` subclass.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from preprocess.errors import CorruptImage, ImageTooLarge, UnsupportedImageFormat
from preprocess.structure import check_scan_count, check_structure
from preprocess.transform import ImageTransform

_EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = frozenset((5, 6, 7, 8))  # transpose / rotate ±90°
_PNG_TRAILING_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


@dataclass(frozen=True)
class RawImage:
    """A decoded `PIL.Image` flattened to what can cross a process boundary and be hashed.

    Carries everything `convert_to_rgb` looks at: mode, palette and the `transparency` entry.
    """

    mode: str
    size: tuple[int, int]  # (width, height), PIL order
    pixels: bytes
    palette_mode: str | None = None
    palette: bytes | None = None
    transparency: int | bytes | tuple[int, ...] | None = None

    @classmethod
    def from_pil(cls, image: Image.Image) -> RawImage:
        image.load()
        has_palette = image.mode in ("P", "PA") and image.palette is not None
        return cls(
            mode=image.mode,
            size=image.size,
            pixels=image.tobytes(),
            palette_mode=image.palette.mode if has_palette else None,
            palette=bytes(image.getpalette(rawmode=None)) if has_palette else None,
            transparency=image.info.get("transparency"),
        )

    def to_pil(self) -> Image.Image:
        image = Image.frombytes(self.mode, self.size, self.pixels)
        if self.palette is not None:
            image.putpalette(self.palette, rawmode=self.palette_mode)
        if self.transparency is not None:
            image.info["transparency"] = self.transparency
        return image


ImageSource = bytes | RawImage


def open_encoded(data: bytes, settings: ImageTransform) -> Image.Image:
    """Parse the header only (no pixels decoded) and check the announced size, after the
    container's structure (see structure.py)."""
    if not data:
        raise UnsupportedImageFormat("image data is empty")
    check_structure(data)
    try:
        image = Image.open(io.BytesIO(data), formats=settings.formats)
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"image is too large to decode safely: {exc}") from None
    except UnidentifiedImageError:
        raise UnsupportedImageFormat(
            f"not an image in a supported format ({', '.join(settings.formats)})"
        ) from None
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # Pillow raises many types on malformed headers
        raise CorruptImage(f"image header is malformed: {exc}") from None
    settings.check_size(image.width, image.height)
    return image


def oriented_size(image: Image.Image, data: bytes) -> tuple[int, int]:
    """(width, height) after EXIF orientation, read without decoding pixels where possible."""
    try:
        if image.format == "PNG" and "exif" not in image.info and _png_may_have_trailing_metadata(data):
            # PNG metadata after the pixel data is only read by a full decode; rare enough.
            image.load()
            exif = image.getexif()
        else:
            # The base-class reader parses what the header already gave; PNG's override would decode.
            exif = Image.Image.getexif(image)
        orientation = exif.get(_EXIF_ORIENTATION, 1)
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:
        raise CorruptImage(f"image metadata is malformed: {exc}") from None
    width, height = image.size
    return (height, width) if orientation in _SWAPS_SIDES else (width, height)


def _png_may_have_trailing_metadata(data: bytes) -> bool:
    """Conservative: a false positive costs a decode, never a wrong answer."""
    first_idat = data.find(b"IDAT")
    return first_idat >= 0 and any(data.find(tag, first_idat) >= 0 for tag in _PNG_TRAILING_METADATA)


def decode_rgb(source: ImageSource, settings: ImageTransform) -> Image.Image:
    """Decode `source` to an RGB image equal to what transformers would process."""
    if isinstance(source, RawImage):
        settings.check_size(*source.size)
        return to_rgb(source.to_pil())
    image = open_encoded(source, settings)
    check_scan_count(source)
    try:
        image.load()
        # `exif_transpose` returns a full copy even when there is nothing to do; skip that case.
        if image.getexif().get(_EXIF_ORIENTATION, 1) != 1:
            image = ImageOps.exif_transpose(image)
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # truncated data surfaces as OSError, others as assorted types
        raise CorruptImage(f"image data is truncated or corrupt ({image.format}): {exc}") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb` for PIL images: alpha composited onto white."""
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image if image.mode == "RGB" else image.convert("RGB")
    except ValueError as exc:  # e.g. "conversion from La to RGB not supported"
        raise UnsupportedImageFormat(f"image mode {image.mode} cannot be converted to RGB: {exc}") from None
