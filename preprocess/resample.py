"""Bicubic resize of RGB uint8 pixels, bit-identical to the installed Pillow's `Image.resize`.

transformers' PIL image processors resize with Pillow, so its result is what the model must see.
`csrc/preprocess/resample_bicubic.cpp` computes the same integers about 4× faster (vectorised;
see BENCHMARKS.md). One thing is not in the arithmetic: Pillow rounds to uint8 between its two
passes, so the order of the passes shows in the result, and Pillow 13 changed it: it runs the
vertical pass first when the height shrinks by more than twice as many pixels as the width
(`ImagingResampleInner`); older Pillows always run the horizontal pass first.

`kernel()` loads the library once per process and checks it against this Pillow on a few
geometries that take each order. If it cannot be built, or a future Pillow disagrees, resizing
falls back to Pillow itself with a warning: the pixels stay right, only slower.

`resize_image` reads a decoded image's pixels where Pillow keeps them (4 bytes per RGB pixel),
found through the Arrow C data interface Pillow exports (a stable ABI), instead of copying them
out packed first: that copy cost as much as the resize in the workers' profile.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import PIL
from PIL import Image

from preprocess.native import checked_kernel, load

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
        self._function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._function.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._function.restype = ctypes.c_int

    def __call__(self, rgb: np.ndarray, height: int, width: int) -> np.ndarray:
        if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
            raise ValueError(f"expected [H, W, 3] uint8 pixels, got {rgb.shape} {rgb.dtype}")
        source = np.ascontiguousarray(rgb)
        return self.from_address(source.ctypes.data, *source.shape, height, width)

    def from_address(
        self, address: int, in_h: int, in_w: int, pixel_bytes: int, height: int, width: int
    ) -> np.ndarray:
        """Resize the C-contiguous [in_h, in_w, pixel_bytes] uint8 pixels at `address` (3: RGB;
        4: RGBX, X ignored), which the caller keeps alive, to a new [height, width, 3] array."""
        if min(in_h, in_w, height, width) < 1:
            raise ValueError(f"cannot resize {(in_h, in_w)} to {(height, width)}: empty side")
        out = np.empty((height, width, 3), dtype=np.uint8)
        vertical_first = pillow_runs_vertical_first(in_h, in_w, height, width)
        status = self._function(
            address, in_h, in_w, pixel_bytes, out.ctypes.data, height, width, vertical_first
        )
        if status != 0:
            raise MemoryError(f"resizing {in_w}x{in_h} to {width}x{height} failed (status {status})")
        return out


class _ArrowSchema(ctypes.Structure):
    pass


_ArrowSchema._fields_ = [
    ("format", ctypes.c_char_p),
    ("name", ctypes.c_char_p),
    ("metadata", ctypes.c_char_p),
    ("flags", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowSchema))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]


class _ArrowArray(ctypes.Structure):
    pass


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def rgbx_address(image: Image.Image) -> tuple[int, Any] | None:
    """(address of an RGB image's pixels as Pillow stores them, [H, W, 4] RGBX, one piece; the
    Arrow capsule that keeps them valid), or None where Pillow does not export them so (images
    over its 16 MB memory block, Pillows before 11.2, anything not laid out as expected)."""
    if image.mode != "RGB":
        return None
    try:
        schema_capsule, array_capsule = image.__arrow_c_array__()
    except (AttributeError, ValueError):
        return None
    schema = _ArrowSchema.from_address(_capsule_pointer(schema_capsule, b"arrow_schema"))
    array = _ArrowArray.from_address(_capsule_pointer(array_capsule, b"arrow_array"))
    if schema.format != b"+w:4" or schema.n_children != 1 or schema.children[0].contents.format != b"C":
        return None
    child = array.children[0].contents
    pixels = image.width * image.height
    if array.length != pixels or array.offset or child.offset or child.length != 4 * pixels:
        return None
    if array.null_count or child.null_count or child.n_buffers != 2 or not child.buffers[1]:
        return None
    return child.buffers[1], array_capsule


def agrees_with_pillow(kernel: ResizeKernel) -> bool:
    """Whether `kernel` gives Pillow's exact pixels on `_CHECK_GEOMETRIES` (random content),
    from packed RGB and from Pillow's RGBX rows."""
    rng = np.random.default_rng(0)
    for in_h, in_w, out_h, out_w in _CHECK_GEOMETRIES:
        rgb = rng.integers(0, 256, (in_h, in_w, 3), dtype=np.uint8)
        expected = pillow_resize(rgb, out_h, out_w)
        if not np.array_equal(kernel(rgb, out_h, out_w), expected):
            return False
        image = Image.fromarray(rgb, "RGB")
        found = rgbx_address(image)
        if found is not None and not np.array_equal(
            kernel.from_address(found[0], in_h, in_w, 4, out_h, out_w), expected
        ):
            return False
    return True


@functools.cache
def kernel() -> ResizeKernel | None:
    """The checked kernel, or None (with a warning, once per process) when Pillow must do it."""
    return checked_kernel(
        lambda: ResizeKernel(load()),
        agrees_with_pillow,
        "bicubic resize falls back to Pillow",
        f"the compiled kernel does not match Pillow {PIL.__version__} on the check geometries",
    )


def resize_image(image: Image.Image, height: int, width: int) -> np.ndarray:
    """An RGB image's pixels resized to [height, width, 3] uint8, exactly as
    `np.asarray(image.resize((width, height), BICUBIC))`."""
    compiled = kernel()
    if compiled is None:
        return np.asarray(image.resize((width, height), Image.Resampling.BICUBIC))
    found = rgbx_address(image)
    if found is None:
        return compiled(np.asarray(image), height, width)
    address, keep_alive = found
    resized = compiled.from_address(address, image.height, image.width, 4, height, width)
    del keep_alive  # the pixels may go now
    return resized
