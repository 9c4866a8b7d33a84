"""How sizes split across the ranks of a tensor-parallel group.

Attention heads and MLP widths split evenly. KV heads split evenly when there are at least as
many as ranks; with fewer, each KV head is replicated on `world_size / num_kv_heads` consecutive
ranks (rank r holds KV head r // replicas), so every rank still has the KV head its query heads
use. The vocabulary is padded to a multiple of the rank count.
"""

from __future__ import annotations


def divide(total: int, parts: int, what: str = "size") -> int:
    if total % parts:
        raise ValueError(f"{what} {total} does not split evenly over {parts} ranks")
    return total // parts


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    if num_kv_heads >= world_size:
        return divide(num_kv_heads, world_size, "the KV head count")
    divide(world_size, num_kv_heads, "the rank count (replicating fewer KV heads than ranks)")
    return 1


def first_kv_head(rank: int, num_kv_heads: int, world_size: int) -> int:
    """Index of the first KV head rank `rank` holds."""
    if num_kv_heads >= world_size:
        return rank * kv_heads_per_rank(num_kv_heads, world_size)
    return rank // (world_size // num_kv_heads)


def vocab_per_rank(vocab_size: int, world_size: int) -> int:
    """Rows of the (padded) embedding table each rank holds."""
    return -(-vocab_size // world_size)
