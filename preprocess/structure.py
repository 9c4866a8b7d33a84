"""Checks of an encoded image's container structure, run before Pillow parses it.

Pillow walks PNG chunks, JPEG header segments, GIF blocks and TIFF tags in Python, a few
microseconds each, and a valid file may hold millions of them (an 18 MB PNG of 1.5 M empty
chunks took seconds to open). Each walk here stops at a fixed count and is otherwise done
with `bytes.find`, so the check costs milliseconds whatever the file.

JPEG also gets a truncation check: libjpeg treats an end-of-image marker that arrives before
every block is decoded as a warning and fills the rest with grey, so a 600-byte file claiming
5000×5000 pixels decoded (for seconds) and was served. A JPEG's scan data can be no shorter
than the least any encoder can write for its declared size — one Huffman code (at least 1
bit) per 8×8 block in a progressive DC scan, two (DC and end-of-block) in a sequential scan —
and a file below that bound is refused as truncated. Arithmetic-coded and lossless JPEGs,
which admit no such bound (and which browsers do not decode either), are refused.
"""

from __future__ import annotations

import math
import struct

from preprocess.errors import CorruptImage, ImageTooComplex, UnsupportedImageFormat

MAX_PNG_CHUNKS = 10_000
MAX_JPEG_HEADER_SEGMENTS = 1_000  # segments before the first scan (Pillow parses these)
MAX_JPEG_SCANS = 100  # progressive JPEGs use ~10; each scan is another pass over every block
MAX_GIF_BLOCKS = 10_000  # extension sub-blocks before the first frame
MAX_TIFF_TAGS = 1_000
MAX_TIFF_STRIPS = 16_384  # strips or tiles of the first image

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SOF_SEQUENTIAL = (0xC0, 0xC1)  # baseline, extended (Huffman)
_SOF_PROGRESSIVE = 0xC2
_SOF_OTHER = (0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)  # lossless, arithmetic
_SOS, _EOI = 0xDA, 0xD9
_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))  # markers without a length field
_TIFF_STRIP_TAGS = (273, 279, 324, 325)  # StripOffsets, StripByteCounts, TileOffsets, TileByteCounts
_JPEG_TRUNCATED = "image data is truncated or corrupt (JPEG): image file is truncated"


def check_structure(data: bytes) -> None:
    """Raise an `ImageError` if `data` (any format) is too complex to parse cheaply, or is a
    JPEG that is certainly truncated or not Huffman-coded. Formats not listed pass as they are."""
    if data.startswith(_PNG_SIGNATURE):
        _check_png(data)
    elif data.startswith(b"\xff\xd8"):
        _check_jpeg(data)
    elif data.startswith((b"GIF87a", b"GIF89a")):
        _check_gif(data)
    elif data.startswith((b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")):
        _check_tiff(data)


def _check_png(data: bytes) -> None:
    position, chunks = len(_PNG_SIGNATURE), 0
    while position + 8 <= len(data):
        (length,) = struct.unpack_from(">I", data, position)
        kind = data[position + 4 : position + 8]
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise ImageTooComplex(f"the PNG has more than {MAX_PNG_CHUNKS:,} chunks")
        if kind == b"IEND":
            return
        position += 12 + length


def _check_jpeg(data: bytes) -> None:
    position, segments = 2, 0
    frame: tuple[int, int, int, list[tuple[int, int]]] | None = None  # (marker, width, height, sampling)
    while True:
        marker, position = _next_marker(data, position)
        if marker in _STANDALONE:
            continue
        if marker == _EOI:
            raise CorruptImage("the JPEG ends before any image data")
        if position + 2 > len(data):
            raise CorruptImage(f"{_JPEG_TRUNCATED} (in its header)")
        (length,) = struct.unpack_from(">H", data, position)
        segments += 1
        if segments > MAX_JPEG_HEADER_SEGMENTS:
            raise ImageTooComplex(f"the JPEG has more than {MAX_JPEG_HEADER_SEGMENTS:,} header segments")
        if marker in _SOF_OTHER:
            raise UnsupportedImageFormat("arithmetic-coded and lossless JPEGs are not supported")
        if marker in (*_SOF_SEQUENTIAL, _SOF_PROGRESSIVE):
            frame = _frame(data, marker, position)
        position += length
        if marker == _SOS:
            break
    if frame is None:
        raise CorruptImage("the JPEG has image data before its frame header")
    _check_scans(data, position, frame)


def _next_marker(data: bytes, position: int) -> tuple[int, int]:
    """(marker code, position after it). Like libjpeg and Pillow, skips stray bytes before a
    marker and the fill bytes (0xFF) that may precede it."""
    position = data.find(b"\xff", position)
    if position < 0:
        raise CorruptImage(f"{_JPEG_TRUNCATED} (in its header)")
    while position < len(data) and data[position] == 0xFF:
        position += 1
    if position >= len(data):
        raise CorruptImage(f"{_JPEG_TRUNCATED} (in its header)")
    return data[position], position + 1


def _frame(data: bytes, marker: int, position: int) -> tuple[int, int, int, list[tuple[int, int]]]:
    try:
        height, width, count = struct.unpack_from(">xxxHHB", data, position)
        sampling = [(data[position + 9 + 3 * i] >> 4, data[position + 9 + 3 * i] & 15) for i in range(count)]
    except (struct.error, IndexError):
        raise CorruptImage("the JPEG frame header is truncated") from None
    return marker, width, height, sampling


def _check_scans(data: bytes, scan_start: int, frame: tuple[int, int, int, list[tuple[int, int]]]) -> None:
    """Scan data runs from the first scan to the end-of-image marker. The last one in the file
    is taken (found from the end, in microseconds): anything appended after the image only
    lengthens what is counted, which errs towards accepting."""
    marker, width, height, sampling = frame
    end = data.rfind(b"\xff\xd9", scan_start)
    if end < 0:
        raise CorruptImage(f"{_JPEG_TRUNCATED} (no end-of-image marker)")
    if not (width and height and sampling) or any(h == 0 or v == 0 for h, v in sampling):
        return  # Pillow refuses these itself (zero size, or a malformed frame)
    max_h = max(h for h, _ in sampling)
    max_v = max(v for _, v in sampling)
    blocks = sum(
        math.ceil(math.ceil(width * h / max_h) / 8) * math.ceil(math.ceil(height * v / max_v) / 8)
        for h, v in sampling
    )
    bits_per_block = 1 if marker == _SOF_PROGRESSIVE else 2
    least_bytes = blocks * bits_per_block // 8
    if end - scan_start < least_bytes:
        raise CorruptImage(
            f"{_JPEG_TRUNCATED}: {width}x{height} pixels need at least {least_bytes:,} bytes of image "
            f"data, it has {end - scan_start:,}"
        )


def check_scan_count(data: bytes) -> None:
    """Refuse a JPEG of more than `MAX_JPEG_SCANS` scans: libjpeg passes over every block once
    per scan, so a small progressive file of thousands of scans costs minutes of CPU. Counts
    every start-of-scan marker in the file (a thumbnail's too: an overcount of a few), which
    reads the whole file, so it runs where the image is decoded, not in the API server."""
    if data.startswith(b"\xff\xd8") and data.count(b"\xff\xda") > MAX_JPEG_SCANS:
        raise ImageTooComplex(f"the JPEG has more than {MAX_JPEG_SCANS} scans")


def _check_gif(data: bytes) -> None:
    if len(data) < 13:
        return  # Pillow refuses it
    flags = data[10]
    position = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    blocks = 0
    while position < len(data) and data[position] == 0x21:  # an extension, before the first frame
        position += 2  # introducer and label
        blocks += 1
        while position < len(data) and data[position] and blocks <= MAX_GIF_BLOCKS:
            blocks += 1
            position += 1 + data[position]
        if blocks > MAX_GIF_BLOCKS:
            raise ImageTooComplex(f"the GIF has more than {MAX_GIF_BLOCKS:,} blocks before its first frame")
        position += 1  # the terminating empty sub-block


def _check_tiff(data: bytes) -> None:
    """The first image's directory: its tag count and its strip (or tile) count."""
    order = "<" if data[:2] == b"II" else ">"
    big = data[2:4] in (b"+\0", b"\0+")  # BigTIFF: 64-bit offsets and counts
    header, entry, count_format = (16, 20, "Q") if big else (8, 12, "I")
    try:
        (offset,) = struct.unpack_from(order + ("Q" if big else "I"), data, header - (8 if big else 4))
        (tags,) = struct.unpack_from(order + ("Q" if big else "H"), data, offset)
    except struct.error:
        return  # Pillow refuses it
    if tags > MAX_TIFF_TAGS:
        raise ImageTooComplex(f"the TIFF has more than {MAX_TIFF_TAGS:,} tags")
    first = offset + (8 if big else 2)
    for index in range(tags):
        try:
            tag, _, count = struct.unpack_from(order + "HH" + count_format, data, first + index * entry)
        except struct.error:
            return
        if tag in _TIFF_STRIP_TAGS and count > MAX_TIFF_STRIPS:
            raise ImageTooComplex(f"the TIFF has more than {MAX_TIFF_STRIPS:,} strips or tiles")
