"""Each kind of bad image gets its own `ImageError` subclass and a message a client can read,
from the pure path, from the header probe and across a worker process boundary."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from PIL import Image
from preprocess_cases import Processors, case_bytes, encode, ours, png_header_only, rgb_image

from preprocess import (
    CorruptImage,
    EmptyImage,
    ExtremeAspectRatio,
    ImageError,
    ImageTooLarge,
    PreprocessPool,
    UnsupportedImageFormat,
    probe,
)

SUPPORTED = r"\(BMP, GIF, JPEG, PNG, TIFF, WEBP\)"


def _truncated(name: str) -> bytes:
    data = case_bytes(name)
    return data[: len(data) // 2]


BAD_IMAGES: dict[str, tuple[Callable[[], bytes | Image.Image], type[ImageError], str]] = {
    "empty_bytes": (lambda: b"", UnsupportedImageFormat, r"^image data is empty$"),
    "not_an_image": (
        lambda: b"GIF-ish nonsense, not an image",
        UnsupportedImageFormat,
        rf"^not an image in a supported format {SUPPORTED}$",
    ),
    "ico_not_allowed": (
        lambda: encode(rgb_image(32, 32), "ICO"),
        UnsupportedImageFormat,
        rf"^not an image in a supported format {SUPPORTED}$",
    ),
    "truncated_jpeg": (
        lambda: _truncated("jpeg_640x480"),
        CorruptImage,
        r"^image data is truncated or corrupt \(JPEG\): image file is truncated",
    ),
    "truncated_png": (
        lambda: _truncated("png_333x517"),
        CorruptImage,
        r"^image data is truncated or corrupt \(PNG\): ",
    ),
    "zero_width_pil": (lambda: Image.new("RGB", (0, 5)), EmptyImage, r"^image has zero size \(0x5\)$"),
    "header_over_pixel_limit": (
        lambda: png_header_only(9000, 8000),
        ImageTooLarge,
        r"^image is 9000x8000 = 72,000,000 pixels, more than the limit of 64,000,000$",
    ),
    "pillow_decompression_bomb": (
        lambda: png_header_only(100_000, 100_000),
        ImageTooLarge,
        r"^image is too large to decode safely: Image size \(10000000000 pixels\) exceeds limit",
    ),
    "aspect_ratio_over_200": (
        lambda: encode(rgb_image(20, 4020), "PNG"),
        ExtremeAspectRatio,
        r"^image is 20x4020: aspect ratio 201\.0 exceeds the limit of 200$",
    ),
    "mode_without_rgb_conversion": (
        lambda: Image.new("La", (8, 8)),
        UnsupportedImageFormat,
        r"^image mode La cannot be converted to RGB: conversion from La to .* not supported$",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_IMAGES))
def test_bad_image_raises_its_typed_error(name: str, processors: dict[str, Processors]) -> None:
    make, error, message = BAD_IMAGES[name]
    with pytest.raises(error, match=message) as raised:
        ours(make(), processors["tiny"].settings)
    assert isinstance(raised.value, ValueError)  # clients get a 400, not a 500


HEADER_VISIBLE = [
    "empty_bytes",
    "not_an_image",
    "ico_not_allowed",
    "zero_width_pil",
    "header_over_pixel_limit",
    "pillow_decompression_bomb",
    "aspect_ratio_over_200",
]


@pytest.mark.parametrize("name", HEADER_VISIBLE)
def test_probe_refuses_what_the_header_already_shows(name: str, processors: dict[str, Processors]) -> None:
    make, error, message = BAD_IMAGES[name]
    with pytest.raises(error, match=message):
        probe(make(), processors["tiny"].settings)


def test_pixel_limit_is_configurable(processors: dict[str, Processors]) -> None:
    settings = replace(processors["tiny"].settings, max_image_pixels=10_000)
    with pytest.raises(
        ImageTooLarge, match=r"^image is 200x100 = 20,000 pixels, more than the limit of 10,000$"
    ):
        ours(encode(rgb_image(200, 100), "PNG"), settings)
    assert settings.digest == processors["tiny"].settings.digest  # a limit does not change results


def test_errors_cross_the_worker_boundary_typed(make_pool: Callable[..., PreprocessPool]) -> None:
    pool = make_pool(num_workers=1)
    for name in ("truncated_jpeg", "aspect_ratio_over_200", "zero_width_pil"):
        make, error, message = BAD_IMAGES[name]
        with pytest.raises(error, match=message):
            pool.process(make())
    with pool.process(case_bytes("png_56x56")) as good:  # the worker survives bad images
        assert good.grid_thw == (1, 4, 4)
    assert pool.stats().worker_restarts == 0
