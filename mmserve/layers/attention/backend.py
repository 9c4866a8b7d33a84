"""The attention backend interface and the per-step metadata every backend reads (the choice of
backend is `selector.py`'s).

A backend writes the step's keys/values into the paged cache and attends each request's queries
over its context; it also names the kernel set (`mmserve.ops.kernels`) the rest of the model
runs with, so that one flag picks a consistent set: `torch` (the reference), `cpu` (C++,
csrc/), `triton` (GPU, or CPU tensors in Triton's interpreter), `flash_attn` (flash-attn's
paged kernel with the Triton set).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.ops.kernels import Kernels


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
    kernels: Kernels  # the kernel set the model's other layers use with this backend
    # Reads only the metadata's device tensors and host ints (not its numpy copies) and never
    # waits for the device, so a CUDA graph may capture it with padded static inputs: slots of
    # -1 are skipped, and rows of padding requests are computed and ignored.
    supports_cuda_graphs: bool = False
    reads_host_metadata: bool = False  # uses query_start_loc_cpu / seq_lens_cpu

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
