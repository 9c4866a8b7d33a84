"""Attention over a paged KV cache, behind a small backend interface.

A backend writes the step's keys/values into the cache through `slot_mapping` and attends each
request's queries over its cached context through its block table. Backends: the torch
reference (CPU and any device); flash-attn or Triton backends can slot in behind the same
`AttentionBackend` interface.
"""

from mmserve.layers.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
