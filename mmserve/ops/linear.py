"""Linear-layer methods on the CPU: a weight packed once, after loading, into the layout a matmul
reads, and the call that reads it.

`PanelLinear` (csrc's 16-column panels in the weight's dtype: K-pair bfloat16 panels multiplied
by vdpbf16ps, or on AMX tiles from two rows, where the build has them), `OneDnnLinear` (oneDNN's
prepacked weight, as vLLM's CPU backend uses), `PlainLinear` (F.linear, the reference). Which
one each weight gets is decided with every other kernel choice (mmserve/worker/kernel_plan.py,
the measurements in BENCHMARKS.md, "Kernel choices on the CPU"). Each weight gets one method,
so the model holds one copy of it.
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
