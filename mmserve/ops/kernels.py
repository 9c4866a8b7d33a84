"""Kernel sets: the ops one model runs with, chosen once per model by the attention backend.

A `Kernels` bundles one implementation of every op the layers call. Contracts are those of
`mmserve.ops.reference`, loosened in one way the layers rely on: `fused_add_rms_norm` and
`mrope` may work in place (their inputs must not be read again by the caller) and return the
results. Paged attention itself is the attention backend's business (`mmserve.layers.attention`);
the kernel sets carry everything else, vision attention included. `pack_linear`, where a set
has one, repacks each linear layer's weight once after loading (`mmserve.ops.linear`); without
it the layers keep their plain weights and `F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import pairwise

import torch

from mmserve.ops import reference
from mmserve.ops.linear import LinearMethod, bf16_dot_products_lead, float32_outruns_bfloat16, pack_cpu_linear
from mmserve.ops.sdpa import varlen_attention_sdpa


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    mrope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    varlen_attention: Callable[..., torch.Tensor]
    pack_linear: Callable[..., LinearMethod] | None = None  # (weight, small_rows) → method
    vision_rotary: Callable[..., torch.Tensor] = reference.vision_rotary
    quick_gelu: Callable[[torch.Tensor], torch.Tensor] = reference.quick_gelu
    # A bfloat16 model's vision tower is loaded in float32 (faster here: compute-bound, see
    # linear.float32_outruns_bfloat16); its embeddings are handed on in bfloat16.
    float32_vision_tower: bool = False


TORCH_KERNELS = Kernels(
    name="torch",
    rms_norm=reference.rms_norm,
    fused_add_rms_norm=reference.fused_add_rms_norm,
    silu_and_mul=reference.silu_and_mul,
    mrope=reference.mrope,
    varlen_attention=varlen_attention_sdpa,
)
"""Plain torch: the reference every other set is checked against, on any device."""

# Segments up to this many rows go to the C++ varlen kernel, longer ones to SDPA, by the build's
# instruction set. AVX2 (a 2-core AMD EPYC): SDPA was faster for a whole image in a
# full-attention block, the kernel for windows (benchmarks/kernels_cpu.py: 0.66x for the kernel
# on one 1024-patch image, 1.13-2.8x on 64-patch windows). AVX-512 (a 2-core Sapphire Rapids,
# torch's flash kernel on oneDNN's brgemm): SDPA at every length measured, 16-4096 rows, head
# dims 16 and 64: 2-5x in bfloat16, 1.0-2.8x in float32 (BENCHMARKS.md, "Prompt attention
# through torch's flash kernel").
# Where `linear.bf16_dot_products_lead` (AVX512-BF16, no AMX), bfloat16 segments of an even
# head_dim up to 256 go to the kernel's vdpbf16ps path (csrc/varlen_attention_dot.cpp) at every
# length: on a 2-core Zen 4, 1.5-2.3x SDPA's speed on whole images and 2 x 512 / 4 x 256
# patches, 1.1x on 64-patch windows (benchmarks/vision_attention_cpu.py). Where the panels run on
# AMX tiles (`cpu.amx_tiles`), the same segments go to the kernel's AMX path
# (csrc/varlen_attention_amx.cpp): on a 2-core Emerald Rapids it took 0.57-0.91x SDPA's time on
# the mid model's 4,096-patch image, 2 x 512 / 4 x 256 patches and 64-patch windows, and
# 0.92-0.97x at head_dim 80 (padded to 96 on the tiles).
_CPU_VARLEN_MAX_SEGMENT = {"AVX2": 256, "AVX512": 0}
_DOT_VARLEN_MAX_HEAD_DIM = 256


@cache
def cpu_kernels() -> Kernels:
    """The C++ kernels of csrc/ (built on first use); raises KernelBuildError if they cannot be."""
    from mmserve.ops import cpu
    from mmserve.ops._extension import build_target

    cpu.ops()  # build or load now, so a failure surfaces here and not in the first step

    max_segment = _CPU_VARLEN_MAX_SEGMENT.get(build_target().capability, 0)
    bf16_kernel = bf16_dot_products_lead() or cpu.amx_tiles()

    def varlen_attention(query, key, value, cu_seqlens: list[int], scale: float) -> torch.Tensor:
        head_dim = query.shape[-1]
        if (
            bf16_kernel
            and query.dtype == torch.bfloat16
            and head_dim % 2 == 0
            and head_dim <= _DOT_VARLEN_MAX_HEAD_DIM
        ):
            return cpu.varlen_attention(query, key, value, cu_seqlens, scale)
        longest = max((end - start for start, end in pairwise(cu_seqlens)), default=0)
        if longest > max_segment:
            return varlen_attention_sdpa(query, key, value, cu_seqlens, scale)
        return cpu.varlen_attention(query, key, value, cu_seqlens, scale)

    return Kernels(
        name="cpu",
        rms_norm=cpu.rms_norm,
        fused_add_rms_norm=cpu.fused_add_rms_norm,
        silu_and_mul=cpu.silu_and_mul,
        mrope=cpu.mrope,
        varlen_attention=varlen_attention,
        pack_linear=pack_cpu_linear,
        float32_vision_tower=float32_outruns_bfloat16(),
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
