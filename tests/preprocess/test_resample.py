"""The compiled bicubic resize against Pillow, its reference: the same uint8 pixels, bit for bit,
over random geometries (both pass orders, upscaling, one pass alone, 1-pixel sides) and content
that drives the cubic's overshoot into the clamp at 0 and 255, from packed RGB arrays and from
Pillow's own RGBX rows."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from preprocess import native, resample
from preprocess.native import NativeBuildError


@pytest.fixture(scope="module")
def compiled() -> resample.ResizeKernel:
    kernel = resample.kernel()
    assert kernel is not None, "the resize kernel did not build here: the fast path is not in use"
    return kernel


def _content(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Noise, or a 0/255 checkerboard of random cell size (maximal overshoot at every edge)."""
    if rng.random() < 0.5:
        return rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    cell = int(rng.integers(1, 5))
    ys, xs = np.indices(shape)
    board = (((ys // cell) + (xs // cell)) % 2 * 255).astype(np.uint8)
    return np.ascontiguousarray(np.stack([board, 255 - board, board], axis=-1))


def test_random_geometries_give_pillows_pixels(compiled: resample.ResizeKernel) -> None:
    rng = np.random.default_rng(13)
    orders = set()
    for _ in range(600):
        in_h, in_w, out_h, out_w = (int(v) for v in rng.integers(1, 140, 4))
        rgb = _content(rng, (in_h, in_w))
        expected = resample.pillow_resize(rgb, out_h, out_w)
        actual = compiled(rgb, out_h, out_w)
        np.testing.assert_array_equal(actual, expected, err_msg=f"{rgb.shape} -> {(out_h, out_w)}")
        if in_h != out_h and in_w != out_w:
            orders.add(resample.pillow_runs_vertical_first(in_h, in_w, out_h, out_w))
    assert orders == ({False, True} if resample._PILLOW_MAJOR >= 13 else {False})


def test_large_downscale_gives_pillows_pixels(compiled: resample.ResizeKernel) -> None:
    """A photo-sized source, as VisionArena's, to a Qwen2-VL grid: each output reads ~17 taps."""
    rgb = _content(np.random.default_rng(1), (1536, 2048))
    np.testing.assert_array_equal(compiled(rgb, 392, 518), resample.pillow_resize(rgb, 392, 518))


def test_pillows_own_rows_give_pillows_pixels(compiled: resample.ResizeKernel) -> None:
    """`resize_image` reads a decoded image's RGBX rows in place."""
    rng = np.random.default_rng(17)
    for _ in range(200):
        in_h, in_w, out_h, out_w = (int(v) for v in rng.integers(1, 140, 4))
        image = Image.fromarray(_content(rng, (in_h, in_w)), "RGB")
        assert resample.rgbx_address(image) is not None
        expected = np.asarray(image.resize((out_w, out_h), Image.Resampling.BICUBIC))
        np.testing.assert_array_equal(resample.resize_image(image, out_h, out_w), expected)


def test_a_photo_from_pillows_own_rows_gives_pillows_pixels(compiled: resample.ResizeKernel) -> None:
    """The serving path: a photo-sized decoded image, its RGBX rows read in place."""
    image = Image.fromarray(_content(np.random.default_rng(5), (1536, 2048)), "RGB")
    assert resample.rgbx_address(image) is not None
    expected = np.asarray(image.resize((518, 392), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(resample.resize_image(image, 392, 518), expected)


def test_an_image_pillow_keeps_in_pieces_is_copied_out_first(compiled: resample.ResizeKernel) -> None:
    """Over Pillow's 16 MB block its rows are not one piece: the packed copy is resized instead."""
    image = Image.fromarray(_content(np.random.default_rng(4), (1800, 2400)), "RGB")
    assert resample.rgbx_address(image) is None
    expected = np.asarray(image.resize((700, 525), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(resample.resize_image(image, 525, 700), expected)


def test_a_view_with_strides_is_resized_as_its_pixels(compiled: resample.ResizeKernel) -> None:
    rgb = _content(np.random.default_rng(2), (90, 120))[::2, 1::3]
    expected = resample.pillow_resize(np.ascontiguousarray(rgb), 17, 29)
    np.testing.assert_array_equal(compiled(rgb, 17, 29), expected)


def test_the_wrong_pass_order_is_caught_by_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow rounds between passes, so the order shows; the load-time check must notice."""
    kernel = resample.ResizeKernel(resample.load())
    assert resample.agrees_with_pillow(kernel)
    original = resample.pillow_runs_vertical_first
    monkeypatch.setattr(resample, "pillow_runs_vertical_first", lambda *size: not original(*size))
    assert not resample.agrees_with_pillow(kernel)


def test_without_a_compiler_pillow_does_the_resize(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_build() -> None:
        raise NativeBuildError("no C++ compiler found (looked for 'c++')")

    monkeypatch.setattr(resample, "load", no_build)
    resample.kernel.cache_clear()
    try:
        assert resample.kernel() is None
        assert "falls back to Pillow" in caplog.text
        rgb = _content(np.random.default_rng(3), (40, 50))
        expected = resample.pillow_resize(rgb, 11, 13)
        np.testing.assert_array_equal(resample.resize_image(Image.fromarray(rgb), 11, 13), expected)
    finally:
        resample.kernel.cache_clear()


def test_bad_shapes_are_refused(compiled: resample.ResizeKernel) -> None:
    with pytest.raises(ValueError, match="uint8"):
        compiled(np.zeros((4, 4, 3), np.float32), 2, 2)
    with pytest.raises(ValueError, match="empty side"):
        compiled(np.zeros((4, 4, 3), np.uint8), 0, 2)
    with pytest.raises(MemoryError, match="status -2"):  # only RGB and RGBX sources exist
        compiled.from_address(np.zeros(8, np.uint8).ctypes.data, 1, 4, 2, 1, 2)


def test_no_read_past_the_last_byte() -> None:
    """Pixels that end right before an unreadable page: a read past the image's last byte (the
    16-byte groups of the last row) would kill the process with SIGSEGV."""
    script = textwrap.dedent(
        """
        import ctypes, mmap
        import numpy as np
        from preprocess import native, resample

        kernel = resample.kernel()
        assert kernel is not None
        page = mmap.PAGESIZE
        arena = mmap.mmap(-1, 2 * page)
        libc = ctypes.CDLL(None)
        base = ctypes.addressof(ctypes.c_char.from_buffer(arena))
        assert libc.mprotect(ctypes.c_void_p(base + page), page, 0) == 0  # PROT_NONE
        geometries = [(7, 31, 7, 9), (7, 31, 3, 9), (40, 23, 3, 20), (1, 600, 1, 37), (9, 7, 2, 9)]
        for in_h, in_w, out_h, out_w in geometries:
            for pixel_bytes in (3, 4):
                size = in_h * in_w * pixel_bytes
                pixels = np.frombuffer(arena, np.uint8, size, page - size).reshape(in_h, in_w, pixel_bytes)
                pixels[...] = np.random.default_rng(size).integers(0, 256, pixels.shape, dtype=np.uint8)
                rgb = np.ascontiguousarray(pixels[..., :3])
                got = kernel.from_address(pixels.ctypes.data, in_h, in_w, pixel_bytes, out_h, out_w)
                assert np.array_equal(got, resample.pillow_resize(rgb, out_h, out_w))
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-march names of x86-64 targets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_portable_paths_give_pillows_pixels(march: str, tmp_path: Path) -> None:
    """The AVX2 and baseline builds (this machine would pick AVX-512) against Pillow too."""
    library = tmp_path / f"resample-{march}.so"
    native.compile_library(native.compiler(), library, march=march)
    kernel = resample.ResizeKernel(ctypes.CDLL(str(library)))
    assert resample.agrees_with_pillow(kernel)
    rng = np.random.default_rng(7)
    for _ in range(150):
        in_h, in_w, out_h, out_w = (int(v) for v in rng.integers(1, 90, 4))
        rgb = _content(rng, (in_h, in_w))
        np.testing.assert_array_equal(kernel(rgb, out_h, out_w), resample.pillow_resize(rgb, out_h, out_w))
