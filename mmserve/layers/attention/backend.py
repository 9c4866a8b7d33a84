"""The attention backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the batch and in the paged KV cache.

    Requests are laid out back to back: request r owns query rows
    [query_start_loc[r], query_start_loc[r + 1]) and, after this step, has seq_lens[r] tokens of
    context, the last of which are its query tokens. Token i is written to cache slot
    slot_mapping[i] = block_id * block_size + offset.
    """

    num_tokens: int
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks_per_request] int32
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc_cpu: np.ndarray  # host copies, so backends can plan without a device sync
    seq_lens_cpu: np.ndarray
    max_query_len: int
    max_seq_len: int

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """One object per model; stateless across steps (all state is in the KV cache tensors)."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        """Store k/v at their slots, then causal attention of q over each request's context."""


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The best backend available for `device`; the torch reference works everywhere."""
    from mmserve.layers.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
