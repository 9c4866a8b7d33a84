"""Bicubic resize of RGB uint8 pixels, bit-identical to the installed Pillow's `Image.resize`.

transformers' Qwen-VL processors resize with Pillow, so its result is what the model must see.
`csrc/preprocess/resample_bicubic.cpp` computes the same integers about 4× faster (vectorised;
see BENCHMARKS.md). One thing is not in the arithmetic: Pillow rounds to uint8 between its two
passes, so the order of the passes shows in the result, and Pillow 13 changed it: it runs the
vertical pass first when the height shrinks by more than twice as many pixels as the width
(`ImagingResampleInner`); older Pillows always run the horizontal pass first.

`kernel()` loads the library once per process and checks it against this Pillow on a few
geometries that take each order. If it cannot be built, or a future Pillow disagrees, resizing
falls back to Pillow itself with a warning: the pixels stay right, only slower.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import PIL
from PIL import Image

from preprocess.native import NativeBuildError, load

logger = logging.getLogger("preprocess")

_PILLOW_MAJOR = int(PIL.__version__.split(".")[0])
# (in_h, in_w, out_h, out_w): horizontal first, vertical first under Pillow 13, each pass alone,
# upscaling, 1-pixel sides, and a source whose rows end where a 16-byte read would overrun.
_CHECK_GEOMETRIES = (
    (61, 97, 23, 40),
    (80, 40, 12, 21),
    (40, 56, 21, 157),
    (33, 70, 33, 19),
    (70, 33, 19, 33),
    (9, 13, 31, 47),
    (1, 50, 1, 7),
    (50, 1, 7, 1),
    (3, 2, 5, 1),
)


def pillow_runs_vertical_first(in_h: int, in_w: int, out_h: int, out_w: int) -> bool:
    """The pass order of the installed Pillow's bicubic resize, when both passes are needed."""
    if _PILLOW_MAJOR < 13:
        return False
    return in_h - out_h > 0 and in_h - out_h > (in_w - out_w) * 2


def pillow_resize(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """The reference: Pillow's bicubic resize of `rgb` [H, W, 3] uint8 to [height, width, 3]."""
    return np.asarray(Image.fromarray(rgb, "RGB").resize((width, height), Image.Resampling.BICUBIC))


class ResizeKernel:
    """The compiled resize; `__call__` has `pillow_resize`'s contract."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.mmserve_resize_bicubic_rgb
        self._function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self._function.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._function.restype = ctypes.c_int

    def __call__(self, rgb: np.ndarray, height: int, width: int) -> np.ndarray:
        if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
            raise ValueError(f"expected [H, W, 3] uint8 pixels, got {rgb.shape} {rgb.dtype}")
        if min(*rgb.shape[:2], height, width) < 1:
            raise ValueError(f"cannot resize {rgb.shape[:2]} to {(height, width)}: empty side")
        source = np.ascontiguousarray(rgb)
        out = np.empty((height, width, 3), dtype=np.uint8)
        in_h, in_w = source.shape[:2]
        vertical_first = pillow_runs_vertical_first(in_h, in_w, height, width)
        status = self._function(
            source.ctypes.data, in_h, in_w, out.ctypes.data, height, width, vertical_first
        )
        if status != 0:
            raise MemoryError(f"resizing {in_w}x{in_h} to {width}x{height}: out of memory")
        return out


def agrees_with_pillow(kernel: ResizeKernel) -> bool:
    """Whether `kernel` gives Pillow's exact pixels on `_CHECK_GEOMETRIES` (random content)."""
    rng = np.random.default_rng(0)
    for in_h, in_w, out_h, out_w in _CHECK_GEOMETRIES:
        rgb = rng.integers(0, 256, (in_h, in_w, 3), dtype=np.uint8)
        if not np.array_equal(kernel(rgb, out_h, out_w), pillow_resize(rgb, out_h, out_w)):
            return False
    return True


@functools.cache
def kernel() -> ResizeKernel | None:
    """The checked kernel, or None (with a warning, once per process) when Pillow must do it."""
    try:
        candidate = ResizeKernel(load())
    except NativeBuildError as error:
        logger.warning("bicubic resize falls back to Pillow (slower, same pixels): %s", error)
        return None
    if not agrees_with_pillow(candidate):
        logger.warning(
            "bicubic resize falls back to Pillow (slower, same pixels): the compiled kernel does not "
            "match Pillow %s on the check geometries",
            PIL.__version__,
        )
        return None
    return candidate


def resize_bicubic(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """`rgb` [H, W, 3] uint8 -> [height, width, 3] uint8, exactly as `pillow_resize`."""
    compiled = kernel()
    if compiled is None:
        return pillow_resize(rgb, height, width)
    return compiled(rgb, height, width)
