"""Qwen3-VL (dense): the vision tower (vision.py) in front of the Qwen3 language model
(language_model.py), behind the Qwen2-VL model interface.

An item's embeddings are cached as one [num_tokens, (1 + D) · hidden] tensor (the main
embeddings, then the D DeepStack features), so the encoder cache and chunked prefill slice all
of them together; `merge_multimodal_embeddings` splits them again.
"""

from __future__ import annotations

import torch

from mmserve.layers.attention import AttentionMetadata
from mmserve.models.qwen2_vl.config import QwenVLConfig
from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration
from mmserve.models.qwen3_vl.language_model import Qwen3Model
from mmserve.models.qwen3_vl.vision import Qwen3VisionTransformer


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Vision tower + Qwen3 language model + LM head, behind the Qwen2-VL model interface."""

    vision_tower_class = Qwen3VisionTransformer
    language_model_class = Qwen3Model

    def __init__(self, config: QwenVLConfig, encoder_data_parallel: bool = False) -> None:
        super().__init__(config, encoder_data_parallel)
        # (visual rows, DeepStack features) of the step being run: set by
        # merge_multimodal_embeddings, taken by the forward that follows it
        self._deepstack: tuple[torch.Tensor, torch.Tensor] | None = None

    def merge_multimodal_embeddings(
        self, embeds: torch.Tensor, rows: torch.Tensor, mm_embeds: torch.Tensor
    ) -> torch.Tensor:
        """embeds: [T, hidden]; rows: [V]; mm_embeds: [V, (1 + D) · hidden]."""
        hidden = self.config.hidden_size
        embeds[rows] = mm_embeds[:, :hidden].to(embeds.dtype)
        deepstack = mm_embeds[:, hidden:].unflatten(1, (-1, hidden)).transpose(0, 1)  # [D, V, hidden]
        self._deepstack = (rows, deepstack)
        return embeds

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        deepstack, self._deepstack = self._deepstack, None
        return self.model(inputs_embeds, positions, kv_caches, metadata, deepstack)
