"""The Qwen3 language model (as Qwen3-VL uses it) over a paged KV cache, with interleaved M-RoPE.

It differs from Qwen2 in three places: q/k/v have no biases, each head's queries and keys go
through an RMSNorm over head_dim before the rotary embedding, and the three M-RoPE sections
are interleaved over the frequency channels (t, h, w, t, h, w, ...) instead of being laid out
as three contiguous blocks. DeepStack features from the vision tower are added to the visual
tokens' hidden states after the first layers (`Qwen3Model.forward`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.config import ModelConfig
from mmserve.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import MRotaryEmbedding
from mmserve.models.qwen2 import Qwen2MLP


def interleaved_sections(mrope_section: Sequence[int]) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) drives each of the head_dim / 2 frequency channels:
    channel c follows h when c ≡ 1 (mod 3) and c < 3·section_h, w when c ≡ 2 (mod 3) and
    c < 3·section_w, t otherwise. [head_dim / 2] int64."""
    channels = torch.arange(sum(mrope_section))
    rows = torch.zeros_like(channels)
    for row in (1, 2):
        rows[(channels % 3 == row) & (channels < 3 * mrope_section[row])] = row
    return rows


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE with Qwen3-VL's interleaved channel layout; everything else as `MRotaryEmbedding`."""

    def __init__(self, head_dim: int, theta: float, mrope_section: Sequence[int], max_positions: int) -> None:
        super().__init__(head_dim, theta, mrope_section, max_positions)
        self.section_of_channel.copy_(interleaved_sections(mrope_section))


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: MRotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,  # [3, T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        attn = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [T, H, D]
        return self.o_proj(attn.reshape(num_tokens, self.q_size))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: MRotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size)

    def forward(self, positions, x, kv_cache, metadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """Embeddings, decoder layers and the final norm (the checkpoint's `model.language_model.*`)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary_class = InterleavedMRotaryEmbedding if config.mrope_interleaved else MRotaryEmbedding
        self.rotary = rotary_class(
            config.head_dim, config.rope_theta, config.mrope_section, config.max_model_len + 1
        )
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, self.rotary, backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`deepstack`: (rows [V] of the visual tokens in this step, features [D, V, hidden]);
        feature d is added to those rows after layer d, as DeepStack prescribes."""
        x = inputs_embeds
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(positions, x, kv_cache, metadata)
            if deepstack is not None and index < deepstack[1].shape[0]:
                rows, features = deepstack
                x = x.index_add(0, rows, features[index].to(x.dtype))
        return self.norm(x)
