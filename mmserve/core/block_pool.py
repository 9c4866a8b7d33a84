"""KV blocks, their reference counts, the prefix-cache map, and the O(1) LRU free list.

Free blocks form one intrusive doubly linked list in eviction order: allocation pops the head,
freeing appends to the tail, and a prefix hit on a free-but-cached block unlinks it from the
middle — all O(1). A freed block keeps its hash (it stays a cache hit) until allocation reuses
it, which is the only moment a hash is dropped. Nothing here scans, and no per-step objects are
created: the KVBlock objects are made once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from mmserve.core.block_hash import BlockHash


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; head = next to evict."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail: the next block to evict first."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __reversed__(self) -> Iterator[KVBlock]:
        """Tail to head, along the `prev_free` links (a check that both directions agree)."""
        block = self._tail.prev_free
        while block is not self._head:
            yield block
            block = block.prev_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """n fresh blocks (ref_cnt 1) from the head of the free list, evicting their old hashes."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero go to the tail in the order given."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash; the first block with a given hash keeps it."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Forget a block's hash: its contents cannot be trusted (the step writing it failed)."""
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible when no block is in use."""
        if self.free_queue.num_free != len(self.blocks):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
