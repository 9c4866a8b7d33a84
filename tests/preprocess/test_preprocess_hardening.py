"""Images built to cost the server: container structures of millions of parts, JPEGs whose data
cannot fill their declared size, and cached results that must not each hold a file descriptor."""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable

import pytest
from PIL import Image
from preprocess_cases import case_bytes, encode, rgb_array

from mmserve.testing.hostile_images import (
    arithmetic_jpeg,
    gif_with_comment_blocks,
    gif_with_empty_extensions,
    jpeg_claiming,
    jpeg_with_comments,
    png_with_empty_chunks,
    progressive_with_scans,
    tiff,
)
from preprocess import CorruptImage, ImageTooComplex, PreprocessPool, UnsupportedImageFormat
from preprocess.decode import decode_rgb
from preprocess.qwen_vl import QwenVLImageSettings
from preprocess.structure import (
    MAX_GIF_BLOCKS,
    MAX_JPEG_HEADER_SEGMENTS,
    MAX_JPEG_SCANS,
    MAX_PNG_CHUNKS,
    MAX_TIFF_STRIPS,
    MAX_TIFF_TAGS,
    check_structure,
)

SETTINGS = QwenVLImageSettings()


TOO_COMPLEX: dict[str, Callable[[], bytes]] = {
    "png_chunks_before_image_data": lambda: png_with_empty_chunks(MAX_PNG_CHUNKS),
    "png_chunks_after_image_data": lambda: png_with_empty_chunks(MAX_PNG_CHUNKS, after_image_data=True),
    "jpeg_comment_segments": lambda: jpeg_with_comments(MAX_JPEG_HEADER_SEGMENTS),
    "gif_comment_sub_blocks": lambda: gif_with_comment_blocks(MAX_GIF_BLOCKS + 1),
    "gif_empty_extensions": lambda: gif_with_empty_extensions(MAX_GIF_BLOCKS + 1),
    "tiff_tags": lambda: tiff(extra_tags=MAX_TIFF_TAGS),
    "tiff_strips": lambda: tiff(strips=MAX_TIFF_STRIPS + 1),
}


@pytest.mark.parametrize("name", list(TOO_COMPLEX))
def test_a_container_of_too_many_parts_is_refused_before_pillow_walks_it(name: str) -> None:
    with pytest.raises(ImageTooComplex, match="more than"):
        decode_rgb(TOO_COMPLEX[name](), SETTINGS)


@pytest.mark.parametrize(
    "name,data",
    [
        ("png", lambda: png_with_empty_chunks(MAX_PNG_CHUNKS - 10)),
        ("jpeg", lambda: jpeg_with_comments(MAX_JPEG_HEADER_SEGMENTS - 10)),
        ("gif", lambda: gif_with_comment_blocks(MAX_GIF_BLOCKS - 10)),
        ("tiff_tags", lambda: tiff(extra_tags=MAX_TIFF_TAGS - 20)),
        ("tiff_strips", lambda: tiff(strips=16)),
        ("progressive_jpeg_at_the_scan_limit", lambda: progressive_with_scans(MAX_JPEG_SCANS)),
    ],
)
def test_just_under_each_limit_the_image_decodes(name: str, data: Callable[[], bytes]) -> None:
    assert decode_rgb(data(), SETTINGS).size == (16, 16)


def test_a_progressive_jpeg_of_too_many_scans_is_refused_before_decoding() -> None:
    with pytest.raises(ImageTooComplex, match=f"more than {MAX_JPEG_SCANS} scans"):
        decode_rgb(progressive_with_scans(MAX_JPEG_SCANS + 1), SETTINGS)


def test_millions_of_parts_are_refused_in_milliseconds() -> None:
    """The check stops counting at the limit: 1.5 M empty PNG chunks (18 MB) took Pillow ~5 s."""
    data = png_with_empty_chunks(1_500_000)
    start = time.process_time()
    with pytest.raises(ImageTooComplex):
        check_structure(data)
    assert time.process_time() - start < 0.5  # a generous bound for CPU time, not wall time


@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_whose_data_cannot_fill_its_declared_size_is_refused_as_truncated(progressive: bool) -> None:
    """Was accepted: libjpeg fills what is missing with grey (a 600-byte file, 25 MP decoded)."""
    with pytest.raises(CorruptImage, match=r"truncated: 5000x5000 pixels need at least [\d,]+ bytes"):
        decode_rgb(jpeg_claiming(5000, 5000, progressive), SETTINGS)


def test_jpeg_cut_short_is_refused_whatever_follows_the_cut() -> None:
    photo = encode(Image.fromarray(rgb_array(640, 480)), "JPEG", quality=90)
    for data in (photo[: len(photo) // 2], photo[:400]):
        with pytest.raises(CorruptImage, match="truncated"):
            decode_rgb(data, SETTINGS)


def test_real_jpegs_meet_the_lower_bound_even_when_flat() -> None:
    """A constant image is the cheapest to encode; it still passes (the bound is a proof, not a guess)."""
    flat = Image.new("RGB", (2000, 1500), (90, 90, 90))
    for options in ({}, {"progressive": True}, {"optimize": True}, {"subsampling": 0}, {"quality": 1}):
        assert decode_rgb(encode(flat, "JPEG", **options), SETTINGS).size == (2000, 1500)
    grey = Image.new("L", (2000, 1500), 0)
    assert decode_rgb(encode(grey, "JPEG", optimize=True, progressive=True), SETTINGS).size == (2000, 1500)


def test_an_arithmetic_coded_jpeg_is_refused() -> None:
    with pytest.raises(UnsupportedImageFormat, match="arithmetic"):
        decode_rgb(arithmetic_jpeg(), SETTINGS)


def test_jpeg_with_appended_bytes_and_exif_thumbnail_still_decodes() -> None:
    photo = case_bytes("jpeg_exif_orientation_6")
    assert decode_rgb(photo + b"PK\x03\x04" + b"\0" * 64, SETTINGS).size


def test_cached_images_hold_no_file_descriptor(make_pool: Callable[..., PreprocessPool]) -> None:
    """Each cached image used to keep one descriptor open (CPython's mmap dup()s it), so a
    full cache of small images could exhaust the descriptor limit."""
    pool = make_pool(num_workers=0)
    before = len(os.listdir("/proc/self/fd"))
    held = []
    for seed in range(60):
        image = io.BytesIO()
        Image.new("RGB", (32, 32), (seed, 0, 0)).save(image, "PNG")
        held.append(pool.process(image.getvalue()))
    assert pool.stats().cached_images == 60
    assert len(os.listdir("/proc/self/fd")) - before <= 2
    assert all(not image.pixel_values.flags.writeable for image in held)
    for image in held:
        image.release()
