"""Linear-layer methods on the CPU: a weight packed once, after loading, into the layout the
fastest matmul here reads, and the call that reads it.

`pack_cpu_linear` chooses once per weight, by dtype and by whether the layer runs at small row
counts (a language model's layers: every decode step reads the whole weight for a few rows) or
only at large ones (a vision tower's). Measured with `benchmarks/linear_cpu.py` on a 2-core AVX2
AMD EPYC (BENCHMARKS.md, "CPU linear layers", has the earlier figures):
- float32, small rows: csrc's `packed_linear` over float32 panels: 1.4× (M=1) to 1.7× (M=8-16)
  oneDNN's matmul on one thread, K=768 N=3072; at M=512 on one thread level with oneDNN for the
  language model's shapes (K=768, 2048), but 0.8× on two threads at M=512-2048 under load, so a
  float32 prefill pays that in its linears;
- float32, large rows only: oneDNN's prepacked weight (`torch.ops.mkldnn`, as vLLM's CPU backend
  uses oneDNN): faster than MKL's sgemm at every M, and than the panels at K=2560 N=640 (the
  vision MLP's down projection: 0.77× for the panels at M=512);
- bfloat16, small rows, on AVX512-BF16: csrc's `packed_linear` over K-pair panels multiplied by
  vdpbf16ps, and on AMX tiles from two rows where the CPU has AMX (`bf16_panels_lead`);
- bfloat16 where oneDNN computes in bfloat16 (AVX512-BF16, AMX, AVX-NE-CONVERT) otherwise:
  oneDNN (but where `float32_outruns_bfloat16`, a bf16 model's vision tower is loaded in
  float32, so its layers take the float32 choices);
- bfloat16 elsewhere (AVX2 + FMA): csrc's `packed_linear`, bfloat16 panels accumulated in
  float32, half the bytes of a float32 weight where a step is memory-bound;
- anything else: the plain weight and `F.linear`, the reference.
Each weight gets one method, so the model holds one copy of it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from functools import cache

import torch
import torch.nn.functional as F

logger = logging.getLogger("mmserve.ops")


class LinearMethod(ABC):
    """y = x Wᵀ (+ b) for one weight W [out_features, in_features] that the method holds."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in_features] in the weight's dtype → [..., out_features]."""

    @property
    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of the weight as held (what a step reads)."""


class PlainLinear(LinearMethod):
    """`F.linear` over the weight as loaded: the reference, on any device."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class OneDnnLinear(LinearMethod):
    """oneDNN's matmul over its own blocked copy of the weight (an opaque mkldnn tensor)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.default(x, self.packed, bias, "none", [], "")

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


class PanelLinear(LinearMethod):
    """csrc's `packed_linear` over 16-column panels of the weight in its own dtype, float32 or
    bfloat16 (mmserve.ops.cpu)."""

    def __init__(self, weight: torch.Tensor) -> None:
        from mmserve.ops import cpu

        super().__init__(weight)
        self._packed_linear = cpu.packed_linear
        self.packed = cpu.pack_weight(weight.detach())  # [ceil(N / 16), K, 16] in weight's dtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._packed_linear(x, self.packed, bias, self.out_features)  # [..., N]

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


@cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed matmul runs for `dtype` on this CPU: tried once on a tiny weight
    (its bfloat16 path refuses CPUs without bfloat16 instructions at the first call)."""
    if not torch.backends.mkldnn.is_available():
        return False
    weight = torch.ones(8, 8, dtype=dtype)
    try:
        out = OneDnnLinear(weight)(torch.ones(1, 8, dtype=dtype))
    except RuntimeError as error:
        logger.info("oneDNN has no %s matmul here: %s", dtype, str(error).splitlines()[0])
        return False
    return bool((out == 8).all())


@cache
def float32_outruns_bfloat16() -> bool:
    """Whether compute-bound bfloat16 work runs faster in float32 on this CPU: an Intel CPU with
    AVX512-BF16 and no AMX, where vdpbf16ps retires one per two cycles (16 multiply-adds a cycle
    per core) against 1.7 float32 FMAs (27), measured on a 2-core Emerald Rapids: oneDNN's
    float32 matmul is 1.6-1.7x its bfloat16 one at 512-4096 rows (benchmarks/linear_cpu.py), SDPA
    1.2-1.5x from 512 rows (benchmarks/vision_attention_cpu.py). Not on AMD's Zen 4, whose
    AVX512-BF16 is twice its float32 rate: oneDNN bf16 361-381 GFLOP/s against float32 184-196
    at 512-4096 rows on a 2-core EPYC (same command). Memory-bound work (a decode step's
    matmuls) reads half the bytes in bfloat16 everywhere. MMSERVE_CPU_WIDEN_BF16=never turns it
    off."""
    from mmserve import envs
    from mmserve.ops._extension import cpu_flags, cpu_vendor

    flags = cpu_flags().split()
    slow_dot = cpu_vendor() == "GenuineIntel" and "avx512_bf16" in flags and "amx_bf16" not in flags
    return envs.cpu_widen_bf16() == "auto" and slow_dot


@cache
def bf16_dot_products_lead() -> bool:
    """Whether bfloat16 work is fastest in csrc's own vdpbf16ps kernels: where the build has them
    (AVX512-BF16) and oneDNN has no AMX. Then a bfloat16 layer that also runs at a few rows uses
    K-pair panels: on a 2-core Zen 4 (`python -m benchmarks.linear_cpu --shape 768 4096 --rows
    1 8 256 1024`, and 640 1728, 128 704, 352 128) they take 0.39-0.74x oneDNN's time at 1-8
    rows and 0.97-1.20x at 256-4096 rows: decode is memory-bound (and small calls pay oneDNN's
    overhead), prefill a few percent slower; one copy of the weight either way. And bfloat16
    vision attention runs on csrc's varlen kernel (mmserve.ops.kernels). With AMX, oneDNN's
    matmuls are several times faster than vdpbf16ps, and the panels themselves multiply on AMX
    tiles (`bf16_panels_lead`), as does csrc's varlen kernel."""
    from mmserve.ops import cpu
    from mmserve.ops._extension import cpu_flags

    return cpu.bf16_dot_products() and "amx_bf16" not in cpu_flags().split()


@cache
def bf16_panels_lead() -> bool:
    """Whether a bfloat16 layer that also runs at a few rows (a language model's) is fastest on
    csrc's K-pair panels: where they multiply on vdpbf16ps and oneDNN has no AMX
    (`bf16_dot_products_lead`), and where the panels themselves run on AMX tiles from two rows
    (`cpu.amx_tiles`). On a 2-core Emerald Rapids with AMX (`python -m benchmarks.linear_cpu --shape
    768 2048`, weights streamed from memory) the panels took 0.09 / 0.10 ms at 1 / 8 rows against
    oneDNN's 0.14-0.16 / 0.15-0.17, and 0.27 / 2.0-2.2 ms at 64 / 512 rows against 0.28 / 2.0-2.1;
    oneDNN leads from ~2048 rows (7.2 against 9.8 ms), more than a prefill chunk usually holds.
    The mid model's decode step (`benchmarks.decode_bandwidth`) went from 0.48 / 0.47 of the
    bandwidth floor to 0.78 / 0.55 at batch 1 / 8."""
    from mmserve.ops import cpu

    return bf16_dot_products_lead() or cpu.amx_tiles()


def pack_cpu_linear(weight: torch.Tensor, small_rows: bool = True) -> LinearMethod:
    """The fastest method for `weight` [out_features, in_features] on this CPU (module docstring);
    `small_rows`: the layer also runs at a few rows (decode). The method holds its own copy of
    the weight, so the caller may drop the plain one."""
    if weight.dtype == torch.float32 and small_rows:
        return PanelLinear(weight)
    if weight.dtype == torch.bfloat16 and small_rows and bf16_panels_lead():
        return PanelLinear(weight)
    if weight.dtype in (torch.float32, torch.bfloat16) and onednn_supports(weight.dtype):
        return OneDnnLinear(weight)
    if weight.dtype == torch.bfloat16:
        return PanelLinear(weight)
    return PlainLinear(weight)
