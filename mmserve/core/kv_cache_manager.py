"""Which KV blocks each request holds, prefix-cache lookups, and slot allocation.

Contract with the scheduler: `get_computed_blocks` finds the longest cached prefix of a new
request (never its last token, which must be computed to produce logits); `allocate_slots`
reserves room for the tokens scheduled this step, or returns None when there are not enough
free blocks (the scheduler then preempts); `free` gives every block back, tail first.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.core.block_pool import BlockPool, KVBlock
from mmserve.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of the request already hashed
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached blocks at the start of the request, and the tokens they cover."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed (as vLLM)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once its request is admitted (a request retried next step counts once)."""
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones (including the
        prefix-hit blocks passed in). Returns the ids of newly allocated blocks, or None — with
        nothing changed — when they do not fit."""
        new_computed_blocks = new_computed_blocks or []
        held = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = -(-total_tokens // self.block_size) - len(held) - len(new_computed_blocks)
        # Prefix hits sitting in the free list stop being allocatable once we take them.
        hits_in_free_list = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - hits_in_free_list:
            if not held:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        held.extend(new_blocks)
        self._cache_full_blocks(request, held, total_tokens)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, held: list[KVBlock], num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end <= start:
            return  # the common decode step: no block became full
        for i in range(start, end):
            self.pool.cache(held[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def uncache_from(self, request: Request, first_block: int) -> None:
        """Un-register the request's blocks from index `first_block` on (those a failed step
        may have half written; a block filled there is held by this request alone)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[first_block:]:
            self.pool.uncache(block)
        if self.num_cached_blocks.get(request.request_id, 0) > first_block:
            self.num_cached_blocks[request.request_id] = first_block

    def free(self, request: Request) -> None:
        """Give back all of a request's blocks, last block first, so its tail is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.release(reversed(blocks))

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
