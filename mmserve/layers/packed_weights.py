"""Linear layers whose weight is repacked once, after loading, for the fastest matmul here.

A layer that multiplies by its `weight` inherits `PacksWeight` and calls `self.matmul(x, bias)`:
`F.linear` over the plain weight until `pack_linear_weights` hands it a method chosen for that
weight (`mmserve.ops.linear`, e.g. oneDNN's blocked copy on a CPU). The plain weight is then
dropped, so the model holds one copy, unless another module shares it (an LM head tied to the
embedding, whose lookups need the rows). Loading must be finished first: a dropped weight
cannot be loaded into.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.ops.linear import LinearMethod


class PacksWeight:
    """weight: [out_features, in_features], or [out_features, *kernel] for a convolution whose
    stride is its kernel (a matmul over flattened patches: the trailing dims are flattened)."""

    weight: nn.Parameter | None
    linear_method: LinearMethod | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in_features] → x Wᵀ (+ bias): [..., out_features]."""
        if self.linear_method is None:
            return F.linear(x, self.weight.flatten(1), bias)
        return self.linear_method(x, bias)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.weight.dtype if self.linear_method is None else self.linear_method.dtype


class PatchProjection(PacksWeight, nn.Module):
    """A Conv3d with stride = kernel as a matmul: weight [dim, C, T, P, P] (+ bias [dim]), the
    checkpoint's layout; x: [patches, C·T·P·P] in any float dtype → [patches, dim].

    x may also be [patches, C·P·P], one frame: a still image as the preprocessing pool writes it
    (its transform's `frame_dim`). It is repeated over T here, after the cast to the weight's
    dtype, which is what transformers' processor does before the model: the same values meet the
    same weights, so the result is the same to the bit."""

    def __init__(self, dim: int, in_channels: int, kernel: tuple[int, int, int], bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, in_channels, *kernel))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        self.in_channels, self.temporal = in_channels, kernel[0]
        self.frame_dim = in_channels * kernel[1] * kernel[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight_dtype)
        if x.shape[-1] == self.frame_dim and self.temporal > 1:
            rows = x.shape[0]
            frames = x.reshape(rows, self.in_channels, 1, -1).expand(-1, -1, self.temporal, -1)
            x = frames.reshape(rows, self.frame_dim * self.temporal)  # [patches, C·T·P·P]
        return self.matmul(x, self.bias)


def pack_linear_weights(
    model: nn.Module,
    pack: Callable[..., LinearMethod] | None,
    keep_plain: nn.Module | None = None,
    large_rows_only: nn.Module | None = None,
) -> int:
    """Give every `PacksWeight` layer of `model` the method `pack(weight, small_rows)` makes for
    its weight (none when `pack` is None), except the layers inside `keep_plain` (e.g. a language
    model that torch.compile traces as plain torch). `small_rows` is False inside
    `large_rows_only` (e.g. a vision tower, which never runs a decode step's few rows).
    Returns the number of layers packed."""
    if pack is None:
        return 0
    plain = set() if keep_plain is None else {id(m) for m in keep_plain.modules()}
    large = set() if large_rows_only is None else {id(m) for m in large_rows_only.modules()}
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = 0
    for module in model.modules():
        if not isinstance(module, PacksWeight) or id(module) in plain or module.weight is None:
            continue
        weight = module.weight
        module.linear_method = pack(weight.data.flatten(1), small_rows=id(module) not in large)
        if uses[id(weight)] == 1:
            module.weight = None  # the method holds the only copy the model needs
        packed += 1
    return packed


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and packed weights, each tensor counted once."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    methods = {
        id(m.linear_method): m.linear_method
        for m in model.modules()
        if isinstance(m, PacksWeight) and m.linear_method is not None
    }
    return total + sum(method.weight_bytes for method in methods.values())
