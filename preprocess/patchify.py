"""Normalise and patchify a resized image into its pixels: rows of C·P·P (the frame once;
transformers' processors with a temporal patch repeat it over T) in merge-block order.

`patchify_reference` is the numpy version; `csrc/preprocess/patchify.cpp` writes the same floats
in one pass (a 768-entry lookup, no float arithmetic of its own), about twice as fast and without
the temporaries: in the workers' profile under load, the numpy version's passes were about a
seventh of their CPU time (BENCHMARKS.md, "Zen 4, stop 40"). `kernel()` checks the compiled
one against the reference once per process; if it cannot be built or disagrees, the reference
does the work.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from preprocess.native import checked_kernel, load
from preprocess.normalise import NormaliseSettings, normaliser


class PatchSettings(NormaliseSettings, Protocol):
    """What patchifying reads of a transform's (hashable) settings."""

    patch_size: int
    merge_size: int  # patches are written in blocks of merge_size × merge_size (1: row-major)

    @property
    def frame_dim(self) -> int:
        """C·P·P: the width of a row."""
        ...


@dataclass(frozen=True)
class PatchLayout:
    """Plain `PatchSettings`, for checking the kernel against the reference."""

    patch_size: int = 14
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255

    @property
    def frame_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size


def _output_shape(height: int, width: int, settings: PatchSettings) -> tuple[int, int]:
    return (height // settings.patch_size) * (width // settings.patch_size), settings.frame_dim


def _check_shapes(rgb: np.ndarray, settings: PatchSettings, out: np.ndarray) -> None:
    block = settings.patch_size * settings.merge_size
    tiles = rgb.ndim == 3 and rgb.shape[0] % block == 0 and rgb.shape[1] % block == 0
    if not tiles or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"expected [H, W, 3] uint8, sides multiples of {block}: got {rgb.shape} {rgb.dtype}")
    expected = _output_shape(rgb.shape[0], rgb.shape[1], settings)
    if out.shape != expected or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous {expected} float32 output, got {out.shape} {out.dtype}")


def patchify_reference(rgb: np.ndarray, settings: PatchSettings, out: np.ndarray) -> None:
    """Write normalised patches of `rgb` [H, W, 3] uint8 into `out` [N, C·P·P] float32.

    Row order is (block_h, block_w, merge_h, merge_w); column order is (C, P_h, P_w), as
    transformers lays them out but for T. The transpose runs on uint8 (4× less memory traffic
    than on floats), before normalising.
    """
    p, m = settings.patch_size, settings.merge_size
    height, width, channels = rgb.shape
    gh, gw = height // p, width // p
    # [gh/m, m, p, gw/m, m, p, C] -> [gh/m, gw/m, m, m, C, p, p]
    blocks = rgb.reshape(gh // m, m, p, gw // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
    levels = np.ascontiguousarray(blocks).reshape(gh * gw, channels, p * p)  # [N, C, P·P] uint8
    out.reshape(gh * gw, channels, p * p)[:] = normaliser(settings)(levels)


class PatchifyKernel:
    """The compiled patchify; `__call__` has `patchify_reference`'s contract."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.mmserve_patchify_rgb
        self._function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self._function.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self._function.restype = ctypes.c_int

    def __call__(self, rgb: np.ndarray, settings: PatchSettings, out: np.ndarray) -> None:
        _check_shapes(rgb, settings, out)
        source = np.ascontiguousarray(rgb)
        table = normaliser(settings).table  # [1, 3, 256] float32, C-contiguous
        status = self._function(
            source.ctypes.data,
            source.shape[0],
            source.shape[1],
            table.ctypes.data,
            settings.patch_size,
            settings.merge_size,
            out.ctypes.data,
        )
        if status != 0:
            raise ValueError(f"patchify refused {rgb.shape} (status {status})")


def agrees_with_reference(kernel: PatchifyKernel) -> bool:
    """Whether `kernel` writes the reference's exact floats on random pixels, for the usual
    settings and for ones whose normalisation takes the lookup table."""
    rng = np.random.default_rng(0)
    cases = (
        (PatchLayout(), 2, 3),
        (PatchLayout(patch_size=16, rescale_factor=0.0039, image_std=(0.3, 0.2, 0.1)), 1, 2),
    )
    for settings, blocks_h, blocks_w in cases:
        block = settings.patch_size * settings.merge_size
        rgb = rng.integers(0, 256, (blocks_h * block, blocks_w * block, 3), dtype=np.uint8)
        shape = _output_shape(rgb.shape[0], rgb.shape[1], settings)
        expected, actual = np.empty(shape, np.float32), np.full(shape, np.nan, np.float32)
        patchify_reference(rgb, settings, expected)
        kernel(rgb, settings, actual)
        if not np.array_equal(actual.view(np.uint32), expected.view(np.uint32)):
            return False
    return True


@functools.cache
def kernel() -> PatchifyKernel | None:
    """The checked kernel, or None (with a warning, once per process) when numpy must do it."""
    return checked_kernel(
        lambda: PatchifyKernel(load()),
        agrees_with_reference,
        "patchify falls back to numpy",
        "the compiled kernel disagrees with the reference",
    )


def patchify_into(rgb: np.ndarray, settings: PatchSettings, out: np.ndarray) -> None:
    """`patchify_reference`'s result, from the compiled kernel where there is one."""
    compiled = kernel()
    if compiled is None:
        patchify_reference(rgb, settings, out)
    else:
        compiled(rgb, settings, out)
