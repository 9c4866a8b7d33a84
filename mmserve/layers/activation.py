"""Activation functions by the names Hugging Face configs use."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.kernel_user import UsesKernels
from mmserve.ops import reference


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": reference.quick_gelu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class SiluAndMul(UsesKernels, nn.Module):
    """SwiGLU on a fused [T, 2 * d] gate/up projection → [T, d]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up)


class Activation(UsesKernels, nn.Module):
    """The activation a config names; quick_gelu through the kernel set (one pass on CPU)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.quick_gelu(x) if self.name == "quick_gelu" else self.fn(x)
