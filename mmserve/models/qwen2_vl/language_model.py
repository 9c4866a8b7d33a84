"""The Qwen2 language model over a paged KV cache, with M-RoPE positions.

Tokens of every request in the step are packed into one [T, hidden] batch; attention metadata
says which rows belong to which request. q/k/v and gate/up projections are fused into single
matmuls; `load_language_model_weight` puts the checkpoint's separate tensors into them. Under
tensor parallelism each rank holds its share of the heads and of the MLP width (column-parallel
q/k/v and gate/up, row-parallel o/down: two all-reduces per layer) and of the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.activation import SiluAndMul
from mmserve.layers.attention import Attention, AttentionMetadata
from mmserve.layers.decoder_layer import PreNormDecoderLayer
from mmserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import InterleavedMRotaryEmbedding, MRotaryEmbedding
from mmserve.layers.vocab_embedding import VocabParallelEmbedding
from mmserve.layers.weights import CheckpointTensor, load_parameter
from mmserve.models.qwen2_vl.config import QwenVLConfig

# checkpoint name fragment → (fused parameter fragment, shard index)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class Qwen2Attention(nn.Module):
    def __init__(self, config: QwenVLConfig, rotary: MRotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, bias=config.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation before the rotary embedding: none in Qwen2."""
        return q, k

    def qk_norm_weights(self) -> list[torch.Tensor]:
        """The weights `normalize_qk` applies (q's, then k's; the layer norms' eps): none here."""
        return []

    def forward(
        self,
        positions: torch.Tensor,  # [3, T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, *self.normalize_qk(q, k))
        attn = self.attn(q, k, v, kv_cache, metadata)  # [T, H, D]
        return self.o_proj(attn.reshape(num_tokens, self.q_size))


class Qwen2MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen2DecoderLayer(PreNormDecoderLayer):
    attention_class: type[Qwen2Attention] = Qwen2Attention

    def __init__(self, config: QwenVLConfig, rotary: MRotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size)


class Qwen2Model(nn.Module):
    """Embeddings, decoder layers and the final norm (the checkpoint's `model.*` tensors)."""

    decoder_layer_class: type[Qwen2DecoderLayer] = Qwen2DecoderLayer

    def __init__(self, config: QwenVLConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # One rotary table shared by every layer (a submodule of this model, not of the layers).
        rotary_class = InterleavedMRotaryEmbedding if config.mrope_interleaved else MRotaryEmbedding
        self.rotary = rotary_class(
            config.head_dim, config.rope_theta, config.mrope_section, config.max_model_len + 1
        )
        self.layers = nn.ModuleList(
            self.decoder_layer_class(config, self.rotary) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x, residual = inputs_embeds, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
        x, _ = self.norm(x, residual)
        return x


def load_language_model_weight(params: dict[str, nn.Parameter], name: str, weight: CheckpointTensor) -> str:
    """Fill one `model.*` / `lm_head.*` checkpoint tensor into its parameter (this rank's shard
    of it); returns the name filled. Separate q/k/v and gate/up tensors land in their part of the
    fused parameter."""
    target, shard = name, None
    for fragment, (fused, index) in STACKED_PARAMS.items():
        if fragment in name:
            target, shard = name.replace(fragment, fused), index
            break
    if target not in params:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
    load_parameter(params[target], weight, shard)
    return target
