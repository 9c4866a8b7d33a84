"""The image id and the settings that feed it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from preprocess_cases import Processors, case_bytes, palette_image, rgb_image

from mmserve.testing.checkpoints import checkpoint
from preprocess import mm_hash
from preprocess.decode import RawImage
from preprocess.qwen_vl import QwenVLImageSettings


def test_id_is_128_bit_hex_and_stable(processors: dict[str, Processors]) -> None:
    settings = processors["tiny"].settings
    data = case_bytes("png_56x56")
    key = mm_hash(data, settings)
    assert len(key) == 32 and int(key, 16) >= 0
    assert mm_hash(bytes(data), settings) == key


@pytest.mark.parametrize(
    "change",
    [
        {"patch_size": 16},
        {"merge_size": 1},
        {"temporal_patch_size": 1},
        {"min_pixels": 28 * 28},
        {"max_pixels": 1024 * 28 * 28},
        {"image_mean": (0.5, 0.5, 0.5)},
        {"image_std": (0.5, 0.5, 0.5)},
        {"rescale_factor": 1 / 127.5},
    ],
)
def test_same_bytes_under_different_settings_get_different_ids(change: dict) -> None:
    data = case_bytes("png_56x56")
    assert mm_hash(data, QwenVLImageSettings()) != mm_hash(data, replace(QwenVLImageSettings(), **change))


def test_limits_do_not_change_the_id() -> None:
    data = case_bytes("png_56x56")
    limited = replace(QwenVLImageSettings(), max_image_pixels=1000, formats=("PNG",))
    assert mm_hash(data, QwenVLImageSettings()) == mm_hash(data, limited)


def test_pil_id_covers_mode_size_palette_and_transparency() -> None:
    settings = QwenVLImageSettings()
    base = palette_image(40, 30)
    other_palette = base.copy()
    other_palette.putpalette([255 - v for v in base.getpalette()])
    transparent = base.copy()
    transparent.info["transparency"] = 3
    ids = {mm_hash(image, settings) for image in (base, other_palette, transparent, base.convert("RGB"))}
    assert len(ids) == 4
    assert mm_hash(base.copy(), settings) == mm_hash(RawImage.from_pil(base), settings)


def test_pil_pixels_and_encoded_bytes_never_share_an_id() -> None:
    image = rgb_image(8, 8)
    raw = RawImage.from_pil(image)
    assert mm_hash(raw, QwenVLImageSettings()) != mm_hash(raw.pixels, QwenVLImageSettings())


def test_raw_image_round_trip_keeps_what_conversion_reads() -> None:
    image = palette_image(40, 30)
    image.info["transparency"] = 7
    back = RawImage.from_pil(image).to_pil()
    assert (back.mode, back.size, back.info["transparency"]) == ("P", (40, 30), 7)
    assert back.getpalette() == image.getpalette()
    assert back.tobytes() == image.tobytes()


def test_settings_from_the_tiny_checkpoint_config() -> None:
    config = json.loads((checkpoint("qwen2_vl") / "preprocessor_config.json").read_text())
    settings = QwenVLImageSettings.from_hf_config(config)
    assert settings == QwenVLImageSettings(min_pixels=56 * 56, max_pixels=256 * 28 * 28)


def test_top_level_pixel_bounds_override_size_as_in_transformers() -> None:
    config = {
        "processor_class": "Qwen2VLProcessor",
        "size": {"shortest_edge": 100, "longest_edge": 200_000},
        "max_pixels": 12845056,
    }
    settings = QwenVLImageSettings.from_hf_config(config)
    assert (settings.min_pixels, settings.max_pixels) == (100, 12845056)
    assert QwenVLImageSettings.from_hf_config({}) == QwenVLImageSettings()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"do_normalize": False}, r"unsupported preprocessor config: do_normalize=False"),
        ({"resample": 2}, r"unsupported preprocessor config: resample=2 \(need 3\)"),
    ],
)
def test_configs_we_cannot_honour_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QwenVLImageSettings.from_hf_config({"processor_class": "Qwen2VLProcessor", **config})


def test_settings_validate_themselves() -> None:
    with pytest.raises(ValueError, match="max_pixels"):
        QwenVLImageSettings(min_pixels=1000, max_pixels=10)
    with pytest.raises(ValueError, match="image_std"):
        QwenVLImageSettings(image_std=(0.5, 0.0, 0.5))
