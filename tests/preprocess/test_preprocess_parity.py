"""Our transforms against transformers' `Qwen2VLImageProcessorPil`, and the header-only token
count against full processing, on generated images of every size, mode and format we accept."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image, ImageOps
from preprocess_cases import (
    CASES,
    Processors,
    case_bytes,
    encode,
    ours,
    palette_image,
    reference,
    rgb_image,
    rgba_image,
)
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from preprocess import ExtremeAspectRatio, probe
from preprocess.normalise import normaliser
from preprocess.qwen_vl import QwenVLImageSettings


@pytest.mark.parametrize("name", sorted(CASES))
def test_pixel_values_and_grid_equal_transformers(name: str, processors: dict[str, Processors]) -> None:
    proc = processors[CASES[name][0]]
    assert normaliser(proc.settings).exact_arithmetic  # the fast path is the one under test here
    data = case_bytes(name)
    expected_pixels, expected_grid = reference(data, proc.hf)
    pixels, grid = ours(data, proc.settings)
    np.testing.assert_array_equal(np.asarray([grid]), expected_grid)
    assert pixels.dtype == np.float32
    assert pixels.shape == expected_pixels.shape
    np.testing.assert_allclose(pixels, expected_pixels, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_header_token_count_equals_full_processing(name: str, processors: dict[str, Processors]) -> None:
    settings = processors[CASES[name][0]].settings
    data = case_bytes(name)
    header = probe(data, settings)
    _, grid = ours(data, settings)
    assert header.grid_thw == grid
    assert header.num_tokens == settings.num_tokens(grid) == grid[1] * grid[2] // settings.merge_size**2


@pytest.mark.parametrize("settings_key", ["tiny", "default"])
def test_aspect_ratio_over_200_raises_in_both(settings_key: str, processors: dict[str, Processors]) -> None:
    proc = processors[settings_key]
    data = encode(rgb_image(5801, 29), "PNG")  # 200.03
    with pytest.raises(ValueError, match="aspect ratio"):
        reference(data, proc.hf)
    with pytest.raises(
        ExtremeAspectRatio, match=r"image is 5801x29: aspect ratio 200\.0 exceeds the limit of 200"
    ):
        ours(data, proc.settings)
    with pytest.raises(ExtremeAspectRatio):
        probe(data, proc.settings)


def test_exif_orientation_is_what_load_image_applies(processors: dict[str, Processors]) -> None:
    """The reference's EXIF handling is transformers' own `load_image` (for an RGB image)."""
    data = case_bytes("jpeg_exif_orientation_6")
    loaded = load_image("data:image/jpeg;base64," + base64.b64encode(data).decode())
    transposed = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert loaded.size == transposed.size == (180, 320)
    np.testing.assert_array_equal(np.asarray(loaded), np.asarray(transposed.convert("RGB")))
    assert probe(data, processors["tiny"].settings).width == 180


@pytest.mark.parametrize(
    "make",
    [
        lambda: rgba_image(300, 200),
        lambda: rgba_image(300, 200).convert("LA"),
        lambda: palette_image(300, 200),
        lambda: rgb_image(300, 200).convert("CMYK"),
        lambda: Image.fromarray(np.arange(60000, dtype=np.uint16).reshape(200, 300)),
        lambda: _palette_with_alpha(),
        lambda: rgb_image(4, 700),
    ],
    ids=["rgba", "la", "p", "cmyk", "i16", "p_rgba_palette", "4x700"],
)
def test_pil_input_equals_transformers_on_the_same_pil_image(make, processors: dict[str, Processors]) -> None:
    proc = processors["tiny"]
    image = make()
    expected_pixels, expected_grid = reference(image, proc.hf)
    pixels, grid = ours(image, proc.settings)
    np.testing.assert_array_equal(np.asarray([grid]), expected_grid)
    np.testing.assert_allclose(pixels, expected_pixels, rtol=0, atol=1e-6)
    assert probe(image, proc.settings).grid_thw == grid


def _palette_with_alpha() -> Image.Image:
    image = palette_image(300, 200)
    rgb = image.getpalette()
    rgba = [v for i in range(len(rgb) // 3) for v in (*rgb[3 * i : 3 * i + 3], (i * 37) % 256)]
    image.putpalette(rgba, rawmode="RGBA")
    return image


@pytest.mark.parametrize(("rescale_factor", "fast_path"), [(1 / 255, True), (0.0039, False)])
def test_both_normalisation_paths_equal_transformers(rescale_factor: float, fast_path: bool) -> None:
    """The vectorised division is used only where it is exact; a gather covers the rest."""
    settings = QwenVLImageSettings(rescale_factor=rescale_factor, image_std=(0.3, 0.2, 0.1))
    hf = Qwen2VLImageProcessorPil(rescale_factor=rescale_factor, image_std=[0.3, 0.2, 0.1])
    assert normaliser(settings).exact_arithmetic is fast_path
    data = case_bytes("png_rgba")
    expected_pixels, _ = reference(data, hf)
    pixels, _ = ours(data, settings)
    np.testing.assert_array_equal(pixels, expected_pixels)
