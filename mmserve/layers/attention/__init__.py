"""Attention over a paged KV cache, behind a small backend interface.

A backend writes the step's keys/values into the cache through `slot_mapping` and attends each
request's queries over its cached context through its block table. Backends: `torch` (the
reference, any device), `cpu` (the C++ kernels), `triton` (GPU; CPU in Triton's interpreter),
`flash_attn` (flash-attn's paged varlen kernel, CUDA), chosen by `--attention-backend` (`auto`
picks the fastest that works on the device).
"""

from mmserve.config import ATTENTION_BACKENDS
from mmserve.layers.attention.backend import AttentionBackend, AttentionMetadata
from mmserve.layers.attention.layer import Attention
from mmserve.layers.attention.selector import get_attention_backend, resolve_attention_backend

__all__ = [
    "ATTENTION_BACKENDS",
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "get_attention_backend",
    "resolve_attention_backend",
]
