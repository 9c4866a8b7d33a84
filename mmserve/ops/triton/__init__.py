"""Triton kernels for the GPU path, each with the contract of its `mmserve.ops.reference` twin.

`is_available()` says whether they can run here: Triton importable, and either a CUDA device or
Triton's CPU interpreter, which importing this package turns on where there is no CUDA device
and TRITON_INTERPRET is not set (`interpreter.py`).
The wrappers are exported only where Triton is importable.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["is_available"]


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def is_available() -> bool:
    """Triton importable, and a CUDA device or the interpreter to run its kernels on."""
    return importlib.util.find_spec("triton") is not None and (torch.cuda.is_available() or _interpreter_on())


if importlib.util.find_spec("triton") is not None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
        os.environ["TRITON_INTERPRET"] = "1"  # no GPU: the interpreter is the only way to run them
    if _interpreter_on():
        from mmserve.ops.triton import interpreter

        interpreter.enable()
    from mmserve.ops.triton.activation import silu_and_mul
    from mmserve.ops.triton.kv_cache import write_kv
    from mmserve.ops.triton.norm import fused_add_rms_norm, rms_norm
    from mmserve.ops.triton.rotary import mrope
    from mmserve.ops.triton.unified_attention import paged_attention
    from mmserve.ops.triton.vision_attention import varlen_attention

    __all__ += [
        "fused_add_rms_norm",
        "mrope",
        "paged_attention",
        "rms_norm",
        "silu_and_mul",
        "varlen_attention",
        "write_kv",
    ]
