"""A decoder layer run as one C++ call on the CPU (`mmserve.ops.cpu.decoder_layer`).

Why: a mid-size layer's ten kernel calls from Python, with the views between them, cost ~0.3 ms
a layer on a small CPU — more than a tiny model's arithmetic and over a tenth of a mid model's
decode step. A layer inheriting `FusesOnCpu` says in `fuse()` whether all of it runs on csrc's
kernels (the CPU attention backend, every linear packed into csrc's panels or oneDNN's layout,
one rank) and if so keeps a `FusedDecoderLayer`, which its forward then calls instead of its
modules. `fuse_decoder_layers` does that for a whole model once its weights are packed. The
fused call chains the same ops in the same order, so the results do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.rotary import MRotaryEmbedding
from mmserve.ops import cpu


@dataclass(frozen=True)
class FusedDecoderLayer:
    """What csrc's `decoder_layer` needs besides the step's inputs, gathered once."""

    weights: list[torch.Tensor]  # input norm, qkv, o, post-attention norm, gate_up, down (packed)
    qkv_bias: torch.Tensor | None
    qk_norms: list[torch.Tensor]  # none, or Qwen3's per-head q and k norms
    rotary: MRotaryEmbedding
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float

    def __call__(
        self,
        positions: torch.Tensor,  # [3, T]
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The contract of the layer's own forward (x and residual are overwritten)."""
        rotary = self.rotary
        return cpu.decoder_layer(
            x, residual, positions, kv_cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_table, metadata.slot_mapping, self.weights, self.qkv_bias, self.qk_norms,
            rotary.cos_cache, rotary.sin_cache, rotary.section_of_channel, self.num_heads,
            self.num_kv_heads, self.eps, self.scale,
        )  # fmt: skip


class FusesOnCpu:
    """A decoder layer that can run as one `FusedDecoderLayer` call."""

    fused: FusedDecoderLayer | None = None

    def fuse(self) -> bool:
        """Set `fused` where every part of the layer runs on the CPU kernels; returns whether."""
        raise NotImplementedError


def fuse_decoder_layers(model: nn.Module) -> int:
    """Fuse every layer of `model` that can be (its weights packed already); returns how many."""
    return sum(module.fuse() for module in model.modules() if isinstance(module, FusesOnCpu))
