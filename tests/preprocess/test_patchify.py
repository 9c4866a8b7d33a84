"""The compiled normalise-and-patchify against its numpy reference: the same float32 bits over
random images, patch and merge sizes and both normalisation paths (the exact
division and the lookup table); geometries that do not tile are refused."""

from __future__ import annotations

import numpy as np
import pytest

from preprocess import patchify
from preprocess.normalise import normaliser
from preprocess.qwen_vl import QwenVLImageSettings


@pytest.fixture(scope="module")
def compiled() -> patchify.PatchifyKernel:
    kernel = patchify.kernel()
    assert kernel is not None, "the patchify kernel did not build here: the fast path is not in use"
    return kernel


def _random_settings(rng: np.random.Generator) -> QwenVLImageSettings:
    exact = rng.random() < 0.5
    return QwenVLImageSettings(
        patch_size=int(rng.choice([2, 7, 14, 16])),
        merge_size=int(rng.integers(1, 4)),
        rescale_factor=1 / 255 if exact else float(rng.uniform(0.003, 0.005)),
        image_mean=tuple(float(v) for v in rng.uniform(0.3, 0.6, 3)),
        image_std=tuple(float(v) for v in rng.uniform(0.2, 0.3, 3)),
    )


def test_random_images_give_the_references_floats(compiled: patchify.PatchifyKernel) -> None:
    rng = np.random.default_rng(7)
    paths = set()
    for _ in range(60):
        settings = _random_settings(rng)
        paths.add(normaliser(settings).exact_arithmetic)
        block = settings.patch_size * settings.merge_size
        height, width = (int(v) * block for v in rng.integers(1, 5, 2))
        rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        shape = ((height // settings.patch_size) * (width // settings.patch_size), settings.frame_dim)
        expected, actual = np.empty(shape, np.float32), np.full(shape, np.nan, np.float32)
        patchify.patchify_reference(rgb, settings, expected)
        compiled(rgb, settings, actual)
        np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32), err_msg=f"{settings}")
    assert paths == {True, False}  # both normalisation paths were compared


def test_strided_source_gives_the_references_floats(compiled: patchify.PatchifyKernel) -> None:
    """A view (every other column of a wider image) is read through its own strides."""
    settings = QwenVLImageSettings()
    rgb = np.random.default_rng(3).integers(0, 256, (56, 224, 3), dtype=np.uint8)[:, ::2]
    expected, actual = (
        np.empty((4 * 8, settings.frame_dim), np.float32),
        np.empty((32, settings.frame_dim), np.float32),
    )
    patchify.patchify_reference(rgb, settings, expected)
    compiled(rgb, settings, actual)
    np.testing.assert_array_equal(actual, expected)


def test_geometry_that_does_not_tile_is_refused(compiled: patchify.PatchifyKernel) -> None:
    settings = QwenVLImageSettings()
    out = np.empty((4, settings.frame_dim), np.float32)
    with pytest.raises(ValueError, match="multiples of 28"):
        compiled(np.zeros((28, 42, 3), np.uint8), settings, out)
    with pytest.raises(ValueError, match="float32 output"):
        compiled(np.zeros((28, 28, 3), np.uint8), settings, np.empty((3, settings.frame_dim), np.float32))


def test_a_kernel_that_disagrees_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The load-time check catches a wrong kernel; numpy then does the work, with a warning."""
    monkeypatch.setattr(patchify, "agrees_with_reference", lambda kernel: False)
    patchify.kernel.cache_clear()
    try:
        assert patchify.kernel() is None
        assert "patchify falls back to numpy" in caplog.text
        settings = QwenVLImageSettings()
        rgb = np.random.default_rng(9).integers(0, 256, (28, 56, 3), dtype=np.uint8)
        expected, actual = (np.empty((8, settings.frame_dim), np.float32) for _ in range(2))
        patchify.patchify_reference(rgb, settings, expected)
        patchify.patchify_into(rgb, settings, actual)
        np.testing.assert_array_equal(actual, expected)
    finally:
        patchify.kernel.cache_clear()


def test_the_check_catches_a_wrong_kernel(compiled: patchify.PatchifyKernel) -> None:
    def off_by_one_ulp(rgb: np.ndarray, settings: QwenVLImageSettings, out: np.ndarray) -> None:
        compiled(rgb, settings, out)
        out.view(np.uint32)[0, 0] += 1

    assert patchify.agrees_with_reference(compiled)
    assert not patchify.agrees_with_reference(off_by_one_ulp)
