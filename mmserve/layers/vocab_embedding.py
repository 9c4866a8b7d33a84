"""The token embedding and the LM head split over the vocabulary.

Rank r holds rows [r·n, (r + 1)·n) of the vocabulary padded to a multiple of the rank count (n =
ceil(vocab / ranks); padding rows are zero). The embedding looks up the ids in its range, zeroes
the others and sums over the ranks; the LM head computes its range's logits and all-gathers them
once per step, so every rank holds the same logits and samples the same tokens (each worker keeps
its own copy of every request's tokens, as in vLLM V1: the scheduler never sends them back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.distributed.parallel_state import TensorParallelGroup, get_tp_group
from mmserve.distributed.partition import vocab_per_rank
from mmserve.layers.packed_weights import PacksWeight
from mmserve.layers.weights import CheckpointTensor, check_shape


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_dim: int, group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.group = group or get_tp_group()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = vocab_per_rank(num_embeddings, self.group.world_size)
        self.vocab_start = self.group.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)  # real rows end
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] → [T, embedding_dim]."""
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_start + self.rows_per_rank)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local_ids, self.weight).masked_fill(outside[:, None], 0.0)
        return self.group.all_reduce(x)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        check_shape("vocabulary tensor", (self.num_embeddings, param.shape[1]), loaded)
        real = self.vocab_end - self.vocab_start
        param.data[:real].copy_(loaded.narrow(0, self.vocab_start, real))
        param.data[real:].zero_()


class ParallelLMHead(PacksWeight, VocabParallelEmbedding):
    """The output projection over the vocabulary (its weight may be the embedding's, tied: then
    a packed head holds a second, packed copy and the embedding keeps the plain one)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] → float32 logits [R, vocab], the same on every rank."""
        logits = self.matmul(hidden).float()  # [R, rows_per_rank]
        if self.group.world_size == 1:
            return logits
        return self.group.all_gather(logits, dim=-1)[:, : self.num_embeddings]  # [R, vocab]
