"""The Qwen3 language model (as Qwen3-VL uses it): Qwen2's, with three differences.

q/k/v have no biases (`ModelConfig.qkv_bias`), each head's queries and keys go through an
RMSNorm over head_dim before the rotary embedding, and the three M-RoPE sections are
interleaved over the frequency channels (`ModelConfig.mrope_interleaved`). DeepStack features
from the vision tower are added to the visual tokens' hidden states after the first layers
(`Qwen3Model.forward`).
"""

from __future__ import annotations

import torch

from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import MRotaryEmbedding
from mmserve.models.qwen2_vl.config import QwenVLConfig
from mmserve.models.qwen2_vl.language_model import Qwen2Attention, Qwen2DecoderLayer, Qwen2Model


class Qwen3Attention(Qwen2Attention):
    def __init__(self, config: QwenVLConfig, rotary: MRotaryEmbedding) -> None:
        super().__init__(config, rotary)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], each head's vector normalised over D."""
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return q, k

    def qk_norm_weights(self) -> list[torch.Tensor]:
        return [self.q_norm.weight, self.k_norm.weight]


class Qwen3DecoderLayer(Qwen2DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(Qwen2Model):
    """Embeddings, decoder layers and the final norm (the checkpoint's `model.language_model.*`)."""

    decoder_layer_class = Qwen3DecoderLayer

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`deepstack`: (rows [V] of the visual tokens in this step, features [D, V, hidden]);
        feature d is added to those rows of the hidden state after layer d, as DeepStack does
        (the layer's output and its residual are summed first, in that order, as unfused)."""
        num_features = 0 if deepstack is None else deepstack[1].shape[0]
        x, residual = inputs_embeds, None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(positions, x, residual, kv_cache, metadata)
            if index < num_features:
                rows, features = deepstack
                x = (residual + x).index_add_(0, rows, features[index].to(x.dtype))
                residual = None  # the next layer takes x as the whole stream
        return self.norm(x) if residual is None else self.norm(x, residual)[0]
