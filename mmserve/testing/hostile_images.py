"""Images built to cost a server: valid containers of very many parts, and files whose data
cannot fill their declared size. Shared by the preprocess and the reliability tests."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def small(fmt: str, **options: object) -> bytes:
    """A 16×16 image in `fmt` (black; a palette image for GIF)."""
    return encode(Image.new("P" if fmt == "GIF" else "RGB", (16, 16)), fmt, **options)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_empty_chunks(count: int, after_image_data: bool = False) -> bytes:
    """A valid PNG with `count` empty private ancillary chunks before (or after) its pixels."""
    png = small("PNG")
    cut = len(png) - 12 if after_image_data else png.index(b"IDAT") - 4
    return png[:cut] + png_chunk(b"abCd", b"") * count + png[cut:]


def jpeg_with_comments(count: int) -> bytes:
    """A valid JPEG with `count` empty comment segments in its header."""
    jpeg = small("JPEG")
    return jpeg[:2] + b"\xff\xfe\x00\x02" * count + jpeg[2:]


def gif_with_comment_blocks(count: int) -> bytes:
    """A valid GIF whose comment extension has `count` one-byte sub-blocks."""
    gif = small("GIF")
    frame = gif.index(b"\x2c")
    return gif[:frame] + b"\x21\xfe" + b"\x01x" * count + b"\x00" + gif[frame:]


def gif_with_empty_extensions(count: int) -> bytes:
    gif = small("GIF")
    frame = gif.index(b"\x2c")
    return gif[:frame] + b"\x21\xfe\x00" * count + gif[frame:]


def tiff(extra_tags: int = 0, strips: int = 1) -> bytes:
    """A little-endian 16×16 grey TIFF with `extra_tags` private tags and `strips` strips."""
    entries = [(256, 3, 1, 16), (257, 3, 1, 16), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1)]
    entries += [(277, 3, 1, 1), (278, 3, 1, max(1, 16 // strips))]
    entries += [(50000 + i, 3, 1, 1) for i in range(extra_tags)]
    arrays = {273: [0] * strips, 279: [256 // strips] * strips}
    entries += [(tag, 4, strips, 0) for tag in arrays]
    entries.sort()
    directory_bytes = 2 + 12 * len(entries) + 4
    body, packed = b"", b""
    for tag, kind, count, value in entries:
        if tag in arrays and count > 1:
            packed += struct.pack("<HHII", tag, kind, count, 8 + directory_bytes + len(body))
            body += struct.pack(f"<{count}I", *arrays[tag])
        else:
            value_bytes = struct.pack("<I" if kind == 4 else "<Hxx", value)
            packed += struct.pack("<HHI", tag, kind, count) + value_bytes
    return b"II*\0" + struct.pack("<IH", 8, len(entries)) + packed + b"\0\0\0\0" + body + b"\0" * 256


def jpeg_claiming(width: int, height: int, progressive: bool = False) -> bytes:
    """A 16×16 JPEG whose frame header claims width×height (a few hundred bytes of scan data)."""
    data = bytearray(small("JPEG", progressive=progressive))
    sof = data.find(b"\xff\xc2" if progressive else b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def progressive_with_scans(count: int) -> bytes:
    """A progressive JPEG whose last scan is repeated until there are `count` scans."""
    data = small("JPEG", progressive=True)
    last = data.rindex(b"\xff\xda")
    scans = data.count(b"\xff\xda")
    return data[:last] + data[last:-2] * (count - scans + 1) + b"\xff\xd9"


def arithmetic_jpeg() -> bytes:
    """A JPEG frame marked arithmetic-coded (SOF9)."""
    data = bytearray(small("JPEG"))
    data[data.find(b"\xff\xc0") + 1] = 0xC9
    return bytes(data)
