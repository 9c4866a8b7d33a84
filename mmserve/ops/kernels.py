"""Kernel sets: one implementation of every op the layers call (besides paged attention and the
linears), bundled per backend.

Contracts are those of `mmserve.ops.reference`, loosened in one way the layers rely on:
`fused_add_rms_norm` and `mrope` may work in place (their inputs must not be read again by the
caller) and return the results. Paged attention itself is the attention backend's business
(`mmserve.layers.attention`). Which set a model runs with, and where an op of the CPU set is
replaced by another (vision attention), is decided in mmserve/worker/kernel_plan.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from mmserve.ops import reference
from mmserve.ops.sdpa import varlen_attention_sdpa


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    mrope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    varlen_attention: Callable[..., torch.Tensor]
    vision_rotary: Callable[..., torch.Tensor] = reference.vision_rotary
    quick_gelu: Callable[[torch.Tensor], torch.Tensor] = reference.quick_gelu


TORCH_KERNELS = Kernels(
    name="torch",
    rms_norm=reference.rms_norm,
    fused_add_rms_norm=reference.fused_add_rms_norm,
    silu_and_mul=reference.silu_and_mul,
    mrope=reference.mrope,
    varlen_attention=varlen_attention_sdpa,
)
"""Plain torch: the reference every other set is checked against, on any device."""


@cache
def cpu_kernels() -> Kernels:
    """The C++ kernels of csrc/ (built on first use); raises KernelBuildError if they cannot be."""
    from mmserve.ops import cpu

    cpu.ops()  # build or load now, so a failure surfaces here and not in the first step
    return Kernels(
        name="cpu",
        rms_norm=cpu.rms_norm,
        fused_add_rms_norm=cpu.fused_add_rms_norm,
        silu_and_mul=cpu.silu_and_mul,
        mrope=cpu.mrope,
        varlen_attention=cpu.varlen_attention,
        vision_rotary=cpu.vision_rotary,
        quick_gelu=cpu.quick_gelu,
    )


@cache
def triton_kernels() -> Kernels:
    """The Triton kernels (on CUDA, or on CPU tensors in Triton's interpreter)."""
    from mmserve.ops import triton as triton_ops

    if not triton_ops.is_available():
        raise RuntimeError("Triton kernels need the triton package and a CUDA device (or TRITON_INTERPRET=1)")
    return Kernels(
        name="triton",
        rms_norm=triton_ops.rms_norm,
        fused_add_rms_norm=triton_ops.fused_add_rms_norm,
        silu_and_mul=triton_ops.silu_and_mul,
        mrope=triton_ops.mrope,
        varlen_attention=triton_ops.varlen_attention,
    )
