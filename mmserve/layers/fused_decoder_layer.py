"""A decoder layer run as one C++ call on the CPU (`mmserve.ops.cpu.decoder_layer`).

Why: a mid-size layer's ten kernel calls from Python, with the views between them, cost ~0.3 ms
a layer on a small CPU — more than a tiny model's arithmetic and over a tenth of a mid model's
decode step. `fuse_decoder_layers` replaces each `PreNormDecoderLayer` of a model that the C++
call can run (every linear packed into csrc's panels or oneDNN's layout, its attention on the
CPU backend, one rank) by a `FusedDecoderLayer` with the same call. The fused call chains the
same ops in the same order, so the results do not change. Whether a model is fused at all is
decided with every other kernel choice (mmserve/worker/kernel_plan.py).
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.decoder_layer import PreNormDecoderLayer
from mmserve.ops import cpu
from mmserve.ops.linear import OneDnnLinear, PanelLinear


class FusedDecoderLayer(nn.Module):
    """`layer`'s forward as csrc's `decoder_layer`; `layer` stays a submodule (its weights, packed
    or not, are what the call reads)."""

    def __init__(self, layer: PreNormDecoderLayer) -> None:
        super().__init__()
        self.unfused = layer
        attn = layer.self_attn
        packed = [linear.linear_method.packed for linear in _linears(layer)]
        # input norm, qkv, o, post-attention norm, gate_up, down
        self.weights = [
            layer.input_layernorm.weight,
            *packed[:2],
            layer.post_attention_layernorm.weight,
            *packed[2:],
        ]
        self.qkv_bias = attn.qkv_proj.bias
        self.qk_norms = attn.qk_norm_weights()  # none, or per-head q and k norms
        self.rotary = attn.rotary
        self.num_heads, self.num_kv_heads = attn.attn.num_heads, attn.attn.num_kv_heads
        self.eps = layer.input_layernorm.eps
        self.scale = attn.attn.scale

    def forward(
        self,
        positions: torch.Tensor,  # [3, T]
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The contract of `PreNormDecoderLayer.forward` (x and residual are overwritten)."""
        rotary = self.rotary
        return cpu.decoder_layer(
            x, residual, positions, kv_cache, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_table, metadata.slot_mapping, self.weights, self.qkv_bias, self.qk_norms,
            rotary.cos_cache, rotary.sin_cache, rotary.section_of_channel, self.num_heads,
            self.num_kv_heads, self.eps, self.scale,
        )  # fmt: skip


def _linears(layer: PreNormDecoderLayer) -> list[nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def can_fuse(layer: PreNormDecoderLayer) -> bool:
    """Whether the C++ call can run `layer`: its linears packed for csrc or oneDNN, its attention
    on the CPU backend, one rank (the call does no all-reduce)."""
    linears = _linears(layer)
    return (
        all(isinstance(linear.linear_method, PanelLinear | OneDnnLinear) for linear in linears)
        and layer.self_attn.attn.backend.name == "cpu"
        and layer.self_attn.o_proj.group.world_size == 1
    )


def fuse_decoder_layers(model: nn.Module) -> int:
    """Replace, in their parents, the decoder layers of `model` that can be fused (weights packed
    already); returns how many."""
    fused = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PreNormDecoderLayer) and can_fuse(child):
                setattr(parent, name, FusedDecoderLayer(child))  # a ModuleList takes "0", "1", ...
                fused += 1
    return fused
