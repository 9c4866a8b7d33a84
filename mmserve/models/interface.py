"""What the model runner calls on a family's model: the interface every family's top module
(the class `ModelFamily.model_class` returns) implements."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import nn

from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.weights import CheckpointTensor


class MultiModalModel(Protocol):
    """Built as `cls(config, encoder_data_parallel)` on the target device in the model dtype
    (loader.py), then filled by `load_weights`; which kernels run its ops is decided afterwards
    on the built model (mmserve/worker/kernel_plan.py)."""

    @property
    def vision_tower(self) -> nn.Module:
        """Everything that runs on items only (a decode step never does): its linears are packed
        for many rows, and it may compute in float32 where that is faster."""

    @property
    def language_model(self) -> nn.Module:
        """The decoder (what torch.compile traces): runs every step, decode rows included."""

    def encode_images(
        self, pixel_values: list[torch.Tensor], grid_thw: Sequence[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """Items' pixels (rows concatenated in item order) → one embeddings tensor per item,
        [num_tokens_i, width], on every rank."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] → [T, hidden]."""

    def merge_multimodal_embeddings(
        self, embeds: torch.Tensor, rows: torch.Tensor, mm_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Put item embeddings [V, width] at their placeholder rows [V] of the step's embeds."""

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [position_rows, T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] → float32 logits [R, vocab_size], the same on every rank."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Fill every parameter (this rank's shard) from the checkpoint's tensors; raises for a
        tensor missing or unexpected."""
