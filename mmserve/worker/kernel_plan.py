"""Which implementation runs each op of a model: decided in one place for the device, the model
dtype and the CPU, and applied to the built model. Model files name no backend and no kernel;
what they build runs the torch reference until `apply_kernel_plan`.

The choices (measurements behind them in BENCHMARKS.md, "Kernel choices on the CPU"):
- paged attention: `--attention-backend` (auto: the C++ kernels on a CPU, flash-attn or Triton on
  CUDA; `mmserve.layers.attention.selector`);
- norms, activations, rotary, vision attention: the backend's kernel set; on the CPU, vision
  attention in bfloat16 on csrc's dot-product or AMX kernels where those lead, else csrc's
  kernel for short segments (windows) on AVX2 and torch's SDPA for the rest (`cpu_vision_attention`);
- linear weights, on the CPU: each packed once for the fastest matmul by dtype and by whether
  the layer runs a decode step's few rows (`cpu_linear_method`); `MMSERVE_CPU_LINEAR=torch`
  keeps F.linear;
- a bfloat16 model's vision tower in float32 where float32 outruns bfloat16 (Intel AVX512-BF16
  without AMX; `MMSERVE_CPU_WIDEN_BF16=never` keeps bfloat16);
- each decoder layer as one C++ call where all its parts run on csrc (`MMSERVE_CPU_DECODER_LAYER
  =modules` keeps the modules' calls);
- torch.compile of the language model (`--compilation-config`, `--enforce-eager`): its layers
  then keep plain weights and the torch kernel set, which inductor fuses.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from functools import cache
from itertools import pairwise

import torch
from torch import nn

from mmserve import envs, host_cpu
from mmserve.config import ExecutionConfig, ModelConfig
from mmserve.layers.attention import (
    Attention,
    AttentionBackend,
    get_attention_backend,
    resolve_attention_backend,
)
from mmserve.layers.fused_decoder_layer import fuse_decoder_layers
from mmserve.layers.kernel_user import use_kernels
from mmserve.layers.packed_weights import pack_linear_weights
from mmserve.models.loader import load_model
from mmserve.ops.linear import LinearMethod, OneDnnLinear, PanelLinear, PlainLinear, onednn_supports
from mmserve.ops.sdpa import varlen_attention_sdpa
from mmserve.worker.compilation import compile_language_model

logger = logging.getLogger("mmserve.worker")


@dataclass(frozen=True)
class KernelPlan:
    """What runs one model's ops (see the module docstring)."""

    attention_backend: str  # resolved: torch | cpu | triton | flash_attn
    pack_linears: bool  # each linear weight packed for the CPU's fastest matmul
    vision_tower_float32: bool  # a bfloat16 model's vision tower computes in float32
    fuse_decoder_layers: bool  # decoder layers whose parts all run on csrc: one C++ call each
    compile_language_model: bool  # torch.compile, attention kept as one opaque op per layer

    def describe(self) -> str:
        """One line for the log."""
        flags = [
            name
            for name, on in (
                ("packed linears", self.pack_linears),
                ("float32 vision tower", self.vision_tower_float32),
                ("fused decoder layers", self.fuse_decoder_layers),
                ("compiled language model", self.compile_language_model),
            )
            if on
        ]
        return f"{self.attention_backend} attention backend" + "".join(f", {flag}" for flag in flags)


def plan_kernels(
    execution: ExecutionConfig, device: torch.device, dtype: str, block_size: int, world_size: int
) -> KernelPlan:
    """The plan for a model of `dtype` on `device` (one of `world_size` tensor-parallel ranks)."""
    backend = resolve_attention_backend(
        execution.attention_backend, device, getattr(torch, dtype), block_size
    )
    compiled = not execution.enforce_eager and execution.compilation.compiles(device.type)
    on_cpu_kernels = backend == "cpu"
    packed = device.type == "cpu" and on_cpu_kernels and envs.cpu_linear() == "packed"
    return KernelPlan(
        attention_backend=backend,
        pack_linears=packed,
        vision_tower_float32=on_cpu_kernels and dtype == "bfloat16" and float32_outruns_bfloat16(),
        fuse_decoder_layers=packed
        and not compiled
        and world_size == 1
        and envs.cpu_decoder_layer() == "fused",
        compile_language_model=compiled,
    )


def apply_kernel_plan(
    model: nn.Module,
    plan: KernelPlan,
    execution: ExecutionConfig,
    device: torch.device,
    dtype: str,
    block_size: int,
) -> AttentionBackend:
    """Give the built model (loaded: packing drops plain weights) what `plan` says: its attention
    layers the backend, its other layers the kernel set, its linears their packed weights, its
    decoder layers their fused form, its language model compiled. Returns the backend."""
    backend = get_attention_backend(plan.attention_backend, device, getattr(torch, dtype), block_size)
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
    kernels = backend.kernels
    if backend.name == "cpu":
        kernels = dataclasses.replace(kernels, varlen_attention=cpu_vision_attention())
    use_kernels(model, kernels)
    if plan.vision_tower_float32:
        model.vision_tower.float()  # the model hands its embeddings on in its own dtype
    if plan.pack_linears:
        pack_linear_weights(
            model,
            cpu_linear_method,
            keep_plain=model.language_model if plan.compile_language_model else None,
            large_rows_only=model.vision_tower,
        )
    if plan.fuse_decoder_layers:
        fuse_decoder_layers(model)
    if plan.compile_language_model:
        compile_language_model(model.language_model, execution.compilation)
    logger.info("kernels: %s", plan.describe())
    return backend


def load_planned_model(
    config: ModelConfig,
    device: torch.device,
    execution: ExecutionConfig,
    block_size: int,
    encoder_data_parallel: bool = False,
    world_size: int = 1,
) -> tuple[nn.Module, KernelPlan, AttentionBackend]:
    """The family's model loaded on `device` with its kernels applied: what a worker runs."""
    model = load_model(config, device, encoder_data_parallel)
    plan = plan_kernels(execution, device, config.dtype, block_size, world_size)
    backend = apply_kernel_plan(model, plan, execution, device, config.dtype, block_size)
    return model, plan, backend


# ----------------------------------------------------------------- linear weights on the CPU


def cpu_linear_method(weight: torch.Tensor, small_rows: bool = True) -> LinearMethod:
    """The fastest method for `weight` [out_features, in_features] on this CPU; `small_rows`: the
    layer also runs at a few rows (a decode step). The method holds its own copy of the weight,
    so the caller may drop the plain one.

    - float32 that runs decode rows: csrc's float32 panels (faster than oneDNN at 1-16 rows);
    - bfloat16 that runs decode rows, where `bf16_panels_lead`: csrc's K-pair panels;
    - otherwise float32 / bfloat16 where oneDNN computes it: oneDNN's prepacked weight;
    - bfloat16 elsewhere (AVX2): csrc's bfloat16 panels, widened in registers;
    - anything else: F.linear, the reference."""
    if weight.dtype == torch.float32 and small_rows:
        return PanelLinear(weight)
    if weight.dtype == torch.bfloat16 and small_rows and bf16_panels_lead():
        return PanelLinear(weight)
    if weight.dtype in (torch.float32, torch.bfloat16) and onednn_supports(weight.dtype):
        return OneDnnLinear(weight)
    if weight.dtype == torch.bfloat16:
        return PanelLinear(weight)
    return PlainLinear(weight)


@cache
def bf16_dot_products_lead() -> bool:
    """Whether bfloat16 work is fastest on csrc's own vdpbf16ps kernels: where the build has
    them (AVX512-BF16) and the CPU has no AMX (with AMX, oneDNN's matmuls are several times
    faster than vdpbf16ps, and csrc's panels and vision attention use the tiles instead)."""
    from mmserve.ops import cpu

    return cpu.bf16_dot_products() and "amx_bf16" not in host_cpu.flags().split()


@cache
def bf16_panels_lead() -> bool:
    """Whether a bfloat16 layer that also runs decode rows is fastest on csrc's K-pair panels:
    where they multiply on vdpbf16ps and oneDNN has no AMX (`bf16_dot_products_lead`), or where
    the panels themselves run on AMX tiles from two rows (`cpu.amx_tiles`)."""
    from mmserve.ops import cpu

    return bf16_dot_products_lead() or cpu.amx_tiles()


@cache
def float32_outruns_bfloat16() -> bool:
    """Whether compute-bound bfloat16 work runs faster in float32 on this CPU: an Intel CPU with
    AVX512-BF16 and no AMX, where vdpbf16ps retires one per two cycles against 1.7 float32 FMAs a
    cycle (not on AMD's Zen 4, whose AVX512-BF16 is twice its float32 rate). Memory-bound work (a
    decode step) reads half the bytes in bfloat16 everywhere. MMSERVE_CPU_WIDEN_BF16=never turns
    it off."""
    flags = host_cpu.flags().split()
    slow_dot = host_cpu.vendor() == "GenuineIntel" and "avx512_bf16" in flags and "amx_bf16" not in flags
    return envs.cpu_widen_bf16() == "auto" and slow_dot


# ----------------------------------------------------------------- vision attention on the CPU

# Segments up to this many rows go to csrc's varlen kernel, longer ones to SDPA, by the build's
# instruction set (float32, or bfloat16 where csrc's bfloat16 kernels do not lead).
_CPU_VARLEN_MAX_SEGMENT = {"AVX2": 256, "AVX512": 0}
_BF16_VARLEN_MAX_HEAD_DIM = 256


@cache
def cpu_vision_attention():
    """The CPU kernel set's varlen (vision) attention: bfloat16 segments of an even head_dim up
    to 256 on csrc's vdpbf16ps or AMX kernel where those lead, at every length; otherwise csrc's
    kernel for segments up to the build's limit (windows, on AVX2) and torch's SDPA (its flash
    kernel) for longer ones."""
    from mmserve.ops import cpu
    from mmserve.ops._extension import build_target

    max_segment = _CPU_VARLEN_MAX_SEGMENT.get(build_target().capability, 0)
    bf16_kernel = bf16_dot_products_lead() or cpu.amx_tiles()

    def varlen_attention(query, key, value, cu_seqlens: list[int], scale: float) -> torch.Tensor:
        head_dim = query.shape[-1]
        if (
            bf16_kernel
            and query.dtype == torch.bfloat16
            and head_dim % 2 == 0
            and head_dim <= _BF16_VARLEN_MAX_HEAD_DIM
        ):
            return cpu.varlen_attention(query, key, value, cu_seqlens, scale)
        longest = max((end - start for start, end in pairwise(cu_seqlens)), default=0)
        if longest > max_segment:
            return varlen_attention_sdpa(query, key, value, cu_seqlens, scale)
        return cpu.varlen_attention(query, key, value, cu_seqlens, scale)

    return varlen_attention
