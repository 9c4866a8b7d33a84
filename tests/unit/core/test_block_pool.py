"""The block pool: reference counts, the hash → block map, and the O(1) LRU free list."""

from __future__ import annotations

import pytest
from core_helpers import assert_pool_consistent
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ---------------------------------------------------------------------------- the free list


def test_free_list_starts_in_block_order():
    pool = BlockPool(5, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert_pool_consistent(pool)


def test_free_queue_pops_the_head_appends_to_the_tail_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 0]
    assert queue.num_free == 3


def test_popping_an_empty_free_queue_raises():
    queue = FreeBlockQueue([])
    with pytest.raises(IndexError):
        queue.popleft()


def test_allocation_takes_blocks_from_the_head():
    pool = BlockPool(5, enable_caching=True)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert all(b.ref_cnt == 1 for b in pool.blocks[:2])
    assert free_ids(pool) == [2, 3, 4]


def test_released_blocks_go_to_the_tail_in_the_order_given():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.allocate(3)
    pool.release(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(3)] == [3, 4, 2]  # least recently freed first
    assert_pool_consistent(pool)


def test_a_block_still_referenced_does_not_return_to_the_free_list():
    pool = BlockPool(3, enable_caching=True)
    [block] = pool.allocate(1)
    pool.touch([block])
    pool.release([block])
    assert block.ref_cnt == 1 and 0 not in free_ids(pool)
    pool.release([block])
    assert free_ids(pool) == [1, 2, 0]


def test_allocating_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(3, enable_caching=True)
    pool.allocate(2)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert free_ids(pool) == [2]
    assert_pool_consistent(pool)


# ---------------------------------------------------------------------------- the prefix cache


def test_a_freed_cached_block_stays_a_hit_until_allocation_reuses_it():
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.allocate(1)
    pool.cache(block, h(7))
    pool.release([block])
    assert pool.get_cached_block(h(7)) is block
    pool.allocate(1)  # block 1: the head
    assert pool.get_cached_block(h(7)) is block
    [reused] = pool.allocate(1)
    assert reused is block
    assert pool.get_cached_block(h(7)) is None and block.block_hash is None
    assert_pool_consistent(pool)


def test_touching_a_free_cached_block_unlinks_it_from_the_middle():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    pool.cache(blocks[1], h(1))
    pool.release(blocks)
    pool.touch([blocks[1]])
    assert blocks[1].ref_cnt == 1
    assert free_ids(pool) == [0, 2, 3]
    assert_pool_consistent(pool)


def test_touching_a_used_block_only_adds_a_reference():
    pool = BlockPool(3, enable_caching=True)
    [block] = pool.allocate(1)
    pool.touch([block])
    assert block.ref_cnt == 2 and free_ids(pool) == [1, 2]


def test_the_first_block_cached_under_a_hash_keeps_it():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, h(1))
    pool.cache(b, h(1))
    pool.cache(a, h(2))  # a block keeps its first hash
    assert pool.get_cached_block(h(1)) is a
    assert b.block_hash is None and a.block_hash == h(1)
    assert pool.get_cached_block(h(2)) is None


def test_caching_does_nothing_when_prefix_caching_is_off():
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    pool.cache(block, h(1))
    assert pool.get_cached_block(h(1)) is None and block.block_hash is None


def test_reset_prefix_cache_forgets_every_hash_only_when_no_block_is_used():
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.allocate(1)
    pool.cache(block, h(1))
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(h(1)) is block
    pool.release([block])
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and block.block_hash is None
    assert_pool_consistent(pool)


# ---------------------------------------------------------------------------- property


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / touch (prefix hit) / release / reset sequences against a model:
    a plain list for the free order and a count of references per block."""

    NUM_BLOCKS = 8

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, enable_caching=True)
        self.free_order = list(range(self.NUM_BLOCKS))  # the model of the LRU list
        self.refs = [0] * self.NUM_BLOCKS
        self.held: list[list[KVBlock]] = []  # groups of references, released together

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        if n > len(self.free_order):
            with pytest.raises(ValueError):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        assert [b.block_id for b in blocks] == self.free_order[:n]
        del self.free_order[:n]
        for b in blocks:
            assert b.block_hash is None  # an old hash is evicted on reuse
            self.refs[b.block_id] += 1
        self.held.append(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), key=st.integers(0, 5))
    def cache(self, data, key):
        group = data.draw(st.sampled_from(self.held))
        if group:
            block = data.draw(st.sampled_from(group))
            before = self.pool.get_cached_block(h(key))
            self.pool.cache(block, h(key))
            if before is not None:
                assert self.pool.get_cached_block(h(key)) is before

    @precondition(lambda self: self.pool.cached)
    @rule(data=st.data())
    def touch_a_prefix_hit(self, data):
        block_hash = data.draw(st.sampled_from(sorted(self.pool.cached)))
        block = self.pool.get_cached_block(block_hash)
        self.pool.touch([block])
        if self.refs[block.block_id] == 0:
            self.free_order.remove(block.block_id)
        self.refs[block.block_id] += 1
        self.held.append([block])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data):
        group = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.release(reversed(group))
        for b in reversed(group):
            self.refs[b.block_id] -= 1
            if self.refs[b.block_id] == 0:
                self.free_order.append(b.block_id)

    @rule()
    def reset_prefix_cache(self):
        assert self.pool.reset_prefix_cache() == (not any(self.held))

    @invariant()
    def consistent(self):
        assert_pool_consistent(self.pool)
        assert free_ids(self.pool) == self.free_order
        assert [b.ref_cnt for b in self.pool.blocks] == self.refs

    def teardown(self):
        for group in self.held:
            self.pool.release(reversed(group))
        assert self.pool.num_free_blocks == self.NUM_BLOCKS
        assert_pool_consistent(self.pool)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
