"""The pre-norm decoder layer of the Llama line, shared by the families whose layers have its
shape."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.attention import AttentionMetadata


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(·)), with each residual add fused into the norm after
    it. A subclass builds the parts, which `fused_decoder_layer.py` reads to run the whole layer
    as one C++ call:

    - `input_layernorm`, `post_attention_layernorm`: RMSNorm over hidden;
    - `self_attn`: `qkv_proj` (fused), per-head `normalize_qk` (+ `qk_norm_weights`), `rotary`
      (M-RoPE), `attn` (the paged `Attention`), `o_proj`;
    - `mlp`: `gate_up_proj` (fused), SiLU-and-mul, `down_proj`.
    """

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def forward(
        self,
        positions: torch.Tensor,  # [P, T]
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (its MLP's)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before that output; None first
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the stream before it)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
