"""The attention backend interface, the per-step metadata every backend reads, and the choice.

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

from mmserve.config import ATTENTION_BACKENDS
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


def resolve_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, block_size: int = 16
) -> str:
    """`auto` → the fastest backend that works for the device, model dtype and KV block size:
    on CPU the C++ kernels (torch if they cannot be built here); on CUDA flash-attn where it is
    installed and supports the dtype and block size, else Triton, else torch. Other names are
    checked; `flash_attn` where it cannot run raises with the reason."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "flash_attn":
        reason = _flash_attn_unsupported(device, dtype, block_size)
        if reason is not None:
            raise ValueError(f"--attention-backend flash_attn cannot run here: {reason}")
    if name != "auto":
        return name
    if device.type == "cpu":
        from mmserve.ops import cpu

        return "cpu" if cpu.is_available() else "torch"
    if _flash_attn_unsupported(device, dtype, block_size) is None:
        return "flash_attn"
    from mmserve.ops import triton as triton_ops

    return "triton" if triton_ops.is_available() else "torch"


def _flash_attn_unsupported(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why the flash_attn backend cannot run here, or None (it also needs Triton, for the KV
    write and the other layers' kernels)."""
    from mmserve.ops import flash_attn

    reason = flash_attn.unsupported_reason(device, dtype, block_size)
    if reason is None:
        from mmserve.ops import triton as triton_ops

        if not triton_ops.is_available():
            reason = "it stores keys and values with Triton, which is not installed"
    return reason


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, block_size: int = 16
) -> AttentionBackend:
    """The backend called `name` (see `resolve_attention_backend` for `auto`)."""
    name = resolve_attention_backend(name, device, dtype, block_size)
    if name == "torch":
        from mmserve.layers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from mmserve.layers.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "flash_attn":
        from mmserve.layers.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    from mmserve.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
