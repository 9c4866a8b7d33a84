"""RMSNorm, computed in float32 whatever the activation dtype (as transformers computes it),
optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.kernel_user import UsesKernels


class RMSNorm(UsesKernels, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] → norm(x); with a residual, (norm(x + residual), x + residual). The fused
        form may overwrite both inputs: the caller reads only what it returns."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
