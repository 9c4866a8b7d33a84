"""Whether this machine runs the engine on CUDA, answered without importing torch.

The API server decides `--dtype auto` and refuses CPU-only flags before EngineCore starts, and it
never runs the model, so it must not pay torch's import (over a second) to know the device: it
asks whether the installed torch is a CUDA build (its library folder holds libtorch_cuda.so) and
whether NVML sees a GPU (the driver's management library, which does not create a CUDA context,
so processes started afterwards may still use CUDA).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from pathlib import Path


@functools.cache
def cuda_available() -> bool:
    """What `torch.cuda.is_available()` answers in a fresh process, in the usual cases: a CUDA
    build of torch and at least one visible NVIDIA GPU."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return _torch_has_cuda() and _nvml_device_count() > 0


def _torch_has_cuda() -> bool:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    library_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return any(library_dir.glob("libtorch_cuda*.so*"))


def _nvml_device_count() -> int:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return 0
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return 0
    finally:
        nvml.nvmlShutdown()
    return count.value
