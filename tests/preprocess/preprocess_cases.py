"""Generated test images and the transformers reference, shared by the preprocess tests.

Every image is made here from seeded noise over smooth gradients (noise catches a wrong pixel
order, gradients catch a wrong resize), so no binary files live in the repository.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from preprocess.decode import RawImage, decode_rgb
from preprocess.qwen_vl import QwenVLImageSettings


def rgb_array(width: int, height: int, seed: int = 0) -> np.ndarray:
    """[H, W, 3] uint8: three different gradients plus seeded noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    x /= max(width - 1, 1)
    y /= max(height - 1, 1)
    base = np.stack([x, y, (x + y) / 2], axis=-1) * 215
    noise = np.random.default_rng(seed).integers(0, 40, (height, width, 3))
    return (base + noise).clip(0, 255).astype(np.uint8)


def rgb_image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(rgb_array(width, height, seed))


def alpha_band(width: int, height: int) -> Image.Image:
    """Fully transparent left edge to opaque right edge, with a hole in the middle."""
    alpha = np.tile(np.linspace(0, 255, width, dtype=np.float32), (height, 1))
    alpha[height // 3 : 2 * height // 3, width // 3 : 2 * width // 3] = 0
    return Image.fromarray(alpha.astype(np.uint8), mode="L")


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def with_exif_orientation(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", quality=90, exif=exif.tobytes())


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        chunks.append((data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]))
        pos += 12 + length
    return chunks


def png_from_chunks(chunks: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(
        struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
        for kind, payload in chunks
    )
    return b"\x89PNG\r\n\x1a\n" + body


def png_with_trailing_exif(image: Image.Image, orientation: int) -> bytes:
    """A PNG whose eXIf chunk comes after the pixel data (legal, and only seen by a full decode)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    chunks = png_chunks(encode(image, "PNG", exif=exif.tobytes()))
    exif_chunk = next(c for c in chunks if c[0] == b"eXIf")
    rest = [c for c in chunks if c[0] not in (b"eXIf", b"IEND")]
    return png_from_chunks([*rest, exif_chunk, (b"IEND", b"")])


def png_header_only(width: int, height: int) -> bytes:
    """A tiny file whose header announces `width`×`height` RGB pixels (a decompression bomb)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return png_from_chunks([(b"IHDR", ihdr), (b"IDAT", zlib.compress(b"\0" * 64)), (b"IEND", b"")])


def palette_image(width: int, height: int) -> Image.Image:
    return rgb_image(width, height, seed=3).quantize(colors=64)


def animated_gif(width: int, height: int) -> bytes:
    frames = [rgb_image(width, height, seed).quantize(colors=32) for seed in range(3)]
    return encode(
        frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0, transparency=0
    )


def animated_png(width: int, height: int) -> bytes:
    frames = [rgb_image(width, height, seed) for seed in range(3)]
    return encode(frames[0], "PNG", save_all=True, append_images=frames[1:], duration=50)


def multipage_tiff(width: int, height: int) -> bytes:
    frames = [rgb_image(width, height, seed) for seed in range(2)]
    return encode(frames[0], "TIFF", save_all=True, append_images=frames[1:])


def rgba_image(width: int, height: int) -> Image.Image:
    image = rgb_image(width, height, seed=1).convert("RGBA")
    image.putalpha(alpha_band(width, height))
    return image


# name -> (settings key, encoded image maker)
CASES: dict[str, tuple[str, Callable[[], bytes]]] = {
    # sizes, tiny checkpoint settings (min 56·56, max 256·28·28)
    "png_1x1": ("tiny", lambda: encode(rgb_image(1, 1), "PNG")),
    "png_10x10_under_min": ("tiny", lambda: encode(rgb_image(10, 10), "PNG")),
    "png_28x28": ("tiny", lambda: encode(rgb_image(28, 28), "PNG")),
    "png_56x56": ("tiny", lambda: encode(rgb_image(56, 56), "PNG")),
    "png_40x30_under_min": ("tiny", lambda: encode(rgb_image(40, 30), "PNG")),
    "png_5x900_thin_under_min": ("tiny", lambda: encode(rgb_image(5, 900), "PNG")),
    "png_333x517": ("tiny", lambda: encode(rgb_image(333, 517), "PNG")),
    "png_28x1000": ("tiny", lambda: encode(rgb_image(28, 1000), "PNG")),
    "jpeg_1000x28": ("tiny", lambda: encode(rgb_image(1000, 28), "JPEG", quality=90)),
    "jpeg_5600x28_ratio_200": ("tiny", lambda: encode(rgb_image(5600, 28), "JPEG", quality=90)),
    "jpeg_640x480": ("tiny", lambda: encode(rgb_image(640, 480), "JPEG", quality=90)),
    "jpeg_1024x768": ("tiny", lambda: encode(rgb_image(1024, 768), "JPEG", quality=90)),
    "jpeg_4000x3000": ("tiny", lambda: encode(rgb_image(4000, 3000), "JPEG", quality=85)),
    # modes and formats
    "png_rgba": ("tiny", lambda: encode(rgba_image(300, 200), "PNG")),
    "png_la": ("tiny", lambda: encode(rgba_image(300, 200).convert("LA"), "PNG")),
    "png_l": ("tiny", lambda: encode(rgb_image(300, 200).convert("L"), "PNG")),
    "png_p": ("tiny", lambda: encode(palette_image(300, 200), "PNG")),
    "png_p_transparency": ("tiny", lambda: encode(palette_image(300, 200), "PNG", transparency=5)),
    "png_rgb_transparency": ("tiny", lambda: encode(rgb_image(97, 61), "PNG", transparency=(30, 40, 50))),
    "png_i16": (
        "tiny",
        lambda: encode(Image.fromarray(rgb_array(300, 200)[..., 0].astype(np.uint16) * 300), "PNG"),
    ),
    "png_1bit": ("tiny", lambda: encode(rgb_image(300, 200).convert("1"), "PNG")),
    "png_animated": ("tiny", lambda: animated_png(160, 120)),
    "jpeg_l": ("tiny", lambda: encode(rgb_image(300, 200).convert("L"), "JPEG", quality=90)),
    "jpeg_cmyk": ("tiny", lambda: encode(rgb_image(300, 200).convert("CMYK"), "JPEG", quality=90)),
    "webp_rgb": ("tiny", lambda: encode(rgb_image(300, 200), "WEBP", quality=90)),
    "webp_rgba_lossless": ("tiny", lambda: encode(rgba_image(300, 200), "WEBP", lossless=True)),
    "gif_p": ("tiny", lambda: encode(palette_image(300, 200), "GIF")),
    "gif_animated_transparent": ("tiny", lambda: animated_gif(160, 120)),
    "bmp_rgb": ("tiny", lambda: encode(rgb_image(300, 200), "BMP")),
    "bmp_p": ("tiny", lambda: encode(palette_image(300, 200), "BMP")),
    "tiff_rgb": ("tiny", lambda: encode(rgb_image(300, 200), "TIFF")),
    "tiff_cmyk": ("tiny", lambda: encode(rgb_image(300, 200).convert("CMYK"), "TIFF")),
    "tiff_rgba": ("tiny", lambda: encode(rgba_image(300, 200), "TIFF")),
    "tiff_multipage": ("tiny", lambda: multipage_tiff(160, 120)),
    # orientation
    **{
        f"jpeg_exif_orientation_{o}": (
            "tiny",
            functools.partial(with_exif_orientation, rgb_image(320, 180), o),
        )
        for o in (2, 3, 4, 5, 6, 7, 8)
    },
    "jpeg_xmp_orientation_6": (
        "tiny",
        lambda: encode(
            rgb_image(320, 180),
            "JPEG",
            xmp=b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-'
            b'syntax-ns#"><rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/>'
            b"</rdf:RDF></x:xmpmeta>",
        ),
    ),
    "png_exif_after_pixels_orientation_6": ("tiny", lambda: png_with_trailing_exif(rgb_image(320, 180), 6)),
    # transformers' class defaults (max 28·28·1280)
    "default_png_56x56": ("default", lambda: encode(rgb_image(56, 56), "PNG")),
    "default_png_10x10_under_min": ("default", lambda: encode(rgb_image(10, 10), "PNG")),
    "default_jpeg_1024x768": ("default", lambda: encode(rgb_image(1024, 768), "JPEG", quality=90)),
    "default_png_rgba_700x500": ("default", lambda: encode(rgba_image(700, 500), "PNG")),
    "default_jpeg_4000x3000_exif_6": ("default", lambda: with_exif_orientation(rgb_image(4000, 3000), 6)),
    # Qwen2.5-VL's checkpoint settings
    "qwen2_5_jpeg_640x480": ("qwen2_5", lambda: encode(rgb_image(640, 480), "JPEG", quality=90)),
}


@functools.cache
def case_bytes(name: str) -> bytes:
    return CASES[name][1]()


@dataclass(frozen=True)
class Processors:
    """Our settings and transformers' processor for the same configuration."""

    settings: QwenVLImageSettings
    hf: Qwen2VLImageProcessorPil


def reference(image: bytes | Image.Image, hf: Qwen2VLImageProcessorPil) -> tuple[np.ndarray, np.ndarray]:
    """transformers' output, its pixels with the frame once, as this package writes them
    (`QwenVLImageSettings.frame_dim`), once its T copies are checked identical. Encoded bytes get
    `load_image`'s EXIF transpose first; the processor's own `convert_to_rgb` then composites
    any alpha onto white."""
    if isinstance(image, bytes):
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(image)))
    out = hf(image, return_tensors="np")
    rows = out["pixel_values"].shape[0]
    frames = out["pixel_values"].reshape(rows, 3, hf.temporal_patch_size, -1)  # [N, C, T, P·P]
    assert (frames == frames[:, :, :1]).all(), "transformers' frames of a still image differ"
    return np.ascontiguousarray(frames[:, :, 0]).reshape(rows, -1), out["image_grid_thw"]


def ours(
    image: bytes | Image.Image, settings: QwenVLImageSettings
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Our pure transform path (what a worker runs), into an ordinary array."""
    source = RawImage.from_pil(image) if isinstance(image, Image.Image) else image
    out: dict[str, np.ndarray] = {}

    def allocate(shape: tuple[int, int]) -> np.ndarray:
        out["pixels"] = np.empty(shape, np.float32)
        return out["pixels"]

    grid = settings.process(decode_rgb(source, settings), allocate)
    return out["pixels"], grid
