"""Layers that call ops through a kernel set, and how a model gets its set.

A layer inherits `UsesKernels` and calls `self.kernels.<op>`; constructors take no kernel
argument, so model code stays the same whatever the backend. `use_kernels` hands every such
layer of a model its set once, after loading (the torch reference set until then), as the
kernel plan says (mmserve/worker/kernel_plan.py).
"""

from __future__ import annotations

from torch import nn

from mmserve.ops.kernels import TORCH_KERNELS, Kernels


class UsesKernels:
    kernels: Kernels = TORCH_KERNELS


def use_kernels(model: nn.Module, kernels: Kernels) -> None:
    for module in model.modules():
        if isinstance(module, UsesKernels):
            module.kernels = kernels
