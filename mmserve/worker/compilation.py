"""torch.compile of the language model (`--compilation-config '{"level": 1}'`).

Paged attention stays out of the traced graph: every layer calls it through one opaque torch
custom op (`mmserve::paged_attention`) that runs the configured backend, so dynamo traces the
rest of the language model — projections, norms, rotary, MLPs, between the attention calls —
and inductor fuses it, with the token count dynamic (one compile serves every step size). While
compiled, the language model's layers use the torch reference kernel set: inductor generates
fused kernels from plain torch, which hand-written kernels would hide behind opaque calls. The
vision tower stays eager, with the backend's kernels.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from mmserve.config import CompilationConfig
from mmserve.layers.attention import Attention, AttentionBackend, AttentionMetadata
from mmserve.layers.kernel_user import use_kernels
from mmserve.ops.kernels import TORCH_KERNELS

# The custom op's registry: it takes tensors and numbers only, so a backend travels as its index
# (one entry per compiled model; backends hold no per-step state).
_BACKENDS: list[AttentionBackend] = []


@torch.library.custom_op("mmserve::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, B, S, KVH, D]: this step's keys/values are stored into it
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    slot_mapping: torch.Tensor,  # [T] int64
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    backend_index: int,
) -> torch.Tensor:  # [T, H, D]
    """`AttentionBackend.forward` of the registered backend, with the metadata rebuilt from its
    tensors (host copies made only for a backend that reads them, free on CPU)."""
    backend = _BACKENDS[backend_index]
    if backend.reads_host_metadata or q.device.type == "cpu":
        query_start_loc_cpu, seq_lens_cpu = query_start_loc.cpu().numpy(), seq_lens.cpu().numpy()
    else:  # never read by this backend; a device sync would be the only cost of making them
        query_start_loc_cpu = seq_lens_cpu = np.empty(0, dtype=np.int64)
    metadata = AttentionMetadata(
        num_tokens=q.shape[0],
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )
    return backend.forward(q, k, v, kv_cache, metadata, scale)


@paged_attention_op.register_fake
def _paged_attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    backend_index: int,
) -> torch.Tensor:
    return torch.empty_like(q)  # [T, H, D]


class OpaqueAttention(AttentionBackend):
    """A backend seen through the custom op: what the compiled language model calls."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.name = backend.name
        self.kernels = TORCH_KERNELS
        self.supports_cuda_graphs = backend.supports_cuda_graphs
        self.index = len(_BACKENDS)
        _BACKENDS.append(backend)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return torch.ops.mmserve.paged_attention(
            q,
            k,
            v,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            metadata.slot_mapping,
            scale,
            metadata.max_query_len,
            metadata.max_seq_len,
            self.index,
        )


def compile_language_model(language_model: nn.Module, config: CompilationConfig) -> None:
    """Compile `language_model` in place: its attention layers call their backend through the
    custom op, its other layers take the torch kernel set, and its forward is compiled with
    dynamic token counts. Compilation itself happens on the first call."""
    opaque: dict[int, OpaqueAttention] = {}  # one per backend object (the layers share one)
    for module in language_model.modules():
        if isinstance(module, Attention) and not isinstance(module.backend, OpaqueAttention):
            backend = module.backend
            if id(backend) not in opaque:
                opaque[id(backend)] = OpaqueAttention(backend)
            module.backend = opaque[id(backend)]
    use_kernels(language_model, TORCH_KERNELS)
    language_model.compile(backend=config.backend, dynamic=True)
