"""The KV cache manager: prefix lookups, slot allocation and freeing, against a model of what each
block holds."""

from __future__ import annotations

import xxhash
from core_helpers import IMAGE_TOKEN, assert_pool_consistent
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmserve.core.kv_cache_manager import KVCacheManager
from mmserve.core.request import Request
from mmserve.protocol import MultiModalFeature
from mmserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, tokens: list[int], features=(), block_size: int = BLOCK_SIZE) -> Request:
    return Request(request_id, tokens, list(features), SamplingParams(), block_size)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        free_ids(kv),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {k: b.block_id for k, b in pool.cached.items()},
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
        dict(kv.num_cached_blocks),
    )


def compute(kv: KVCacheManager, request: Request, num_tokens: int, hits=None) -> list[int] | None:
    """What the scheduler does for one span: allocate, then count the tokens as computed."""
    hits = hits or []
    block_ids = kv.allocate_slots(request, num_tokens, hits)
    if block_ids is not None:
        request.num_computed_tokens += len(hits) * kv.block_size + num_tokens
    return block_ids


def test_prefix_lookup_never_covers_the_last_token():
    kv = KVCacheManager(16, BLOCK_SIZE)
    first = make_request("a", list(range(8)))
    compute(kv, first, 8)
    exact = make_request("b", list(range(8)))  # two full blocks, both cached
    hits, num_hit = kv.get_computed_blocks(exact)
    assert num_hit == 4 and len(hits) == 1  # the second block holds the last token
    longer = make_request("c", list(range(9)))
    assert kv.get_computed_blocks(longer)[1] == 8


def test_prefix_lookup_stops_at_the_first_miss():
    kv = KVCacheManager(16, BLOCK_SIZE)
    compute(kv, make_request("a", list(range(12))), 12)
    tokens = list(range(12))
    tokens[5] = 99
    hits, num_hit = kv.get_computed_blocks(make_request("b", [*tokens, 0]))
    assert num_hit == 4 and [b.block_id for b in hits] == [0]


def test_prefix_lookup_finds_nothing_when_caching_is_off():
    kv = KVCacheManager(16, BLOCK_SIZE, enable_prefix_caching=False)
    compute(kv, make_request("a", list(range(12))), 12)
    assert kv.get_computed_blocks(make_request("b", list(range(13)))) == ([], 0)
    assert kv.pool.cached == {}


def test_same_text_different_image_gets_only_the_blocks_before_the_image():
    kv = KVCacheManager(16, BLOCK_SIZE)
    tokens = [1, 2, 3, 4, 5, 6] + [IMAGE_TOKEN] * 8 + [7, 8]
    image_a = [MultiModalFeature("img-a", 6, 8, (1, 1, 8))]
    image_b = [MultiModalFeature("img-b", 6, 8, (1, 1, 8))]
    compute(kv, make_request("a", tokens, image_a), len(tokens))
    assert kv.get_computed_blocks(make_request("b", tokens, image_b))[1] == 4
    assert kv.get_computed_blocks(make_request("c", tokens, image_a))[1] == 12


def test_blocks_are_cached_as_chunked_prefill_fills_them():
    kv = KVCacheManager(16, BLOCK_SIZE)
    request = make_request("a", list(range(14)))
    compute(kv, request, 6)
    assert len(kv.pool.cached) == 1
    compute(kv, request, 6)
    assert len(kv.pool.cached) == 3
    assert [kv.pool.cached[h].block_id for h in request.block_hashes[:3]] == kv.block_ids(request)[:3]


def test_blocks_filled_by_generated_tokens_are_cached_once_computed():
    kv = KVCacheManager(16, BLOCK_SIZE)
    request = make_request("a", list(range(6)))
    compute(kv, request, 6)
    request.append_output_token(50)
    request.append_output_token(51)  # block 1 is full now, but its last token has no KV yet
    assert len(request.block_hashes) == 2 and len(kv.pool.cached) == 1
    compute(kv, request, 1)
    assert len(kv.pool.cached) == 1
    compute(kv, request, 1)
    assert len(kv.pool.cached) == 2


def test_a_shared_prefix_is_held_by_both_requests_until_both_free():
    kv = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", list(range(10)))
    compute(kv, a, 10)
    b = make_request("b", [*list(range(8)), 42, 43])
    hits, num_hit = kv.get_computed_blocks(b)
    assert compute(kv, b, b.num_tokens - num_hit, hits) == [3]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    kv.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_free_puts_a_requests_blocks_at_the_tail_last_block_first():
    kv = KVCacheManager(6, BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    compute(kv, request, 10)
    assert free_ids(kv) == [3, 4, 5]
    kv.free(request)
    assert free_ids(kv) == [3, 4, 5, 2, 1, 0]
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {}


def test_allocate_slots_returns_none_and_changes_nothing_when_blocks_run_out():
    kv = KVCacheManager(4, BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    before = snapshot(kv)
    assert kv.allocate_slots(a, 8) is None  # 17 tokens need 5 blocks: 2 more, 1 is free
    assert snapshot(kv) == before
    newcomer = make_request("b", list(range(30, 38)))
    assert kv.allocate_slots(newcomer, 8) is None
    assert snapshot(kv) == before and "b" not in kv.req_to_blocks


def test_prefix_hits_in_the_free_list_are_not_counted_as_free_room():
    kv = KVCacheManager(4, BLOCK_SIZE)
    a = make_request("a", list(range(8)))
    compute(kv, a, 8)
    kv.free(a)  # blocks 0 and 1: free, still cached
    b = make_request("b", list(range(16)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = snapshot(kv)
    assert kv.allocate_slots(b, 12, hits) is None  # 2 hits + 3 new > 4 blocks
    assert snapshot(kv) == before
    assert compute(kv, b, 8, hits) == [2, 3]  # 2 hits + 2 new: exactly the pool
    assert kv.num_free_blocks == 0
    assert_pool_consistent(kv.pool)


def test_prefix_hits_are_counted_when_the_lookup_is_recorded():
    kv = KVCacheManager(8, BLOCK_SIZE)
    kv.record_prefix_lookup(10, 8)
    kv.record_prefix_lookup(5, 0)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (15, 8)
    off = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    off.record_prefix_lookup(10, 0)
    assert off.prefix_stats.queries == 0


def test_usage_counts_blocks_in_use():
    kv = KVCacheManager(8, BLOCK_SIZE)
    compute(kv, make_request("a", list(range(9))), 9)
    assert (kv.num_used_blocks, kv.num_free_blocks, kv.usage) == (3, 5, 3 / 8)


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    kv = KVCacheManager(8, BLOCK_SIZE)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


# ---------------------------------------------------------------------------- property


def content(request: Request, end: int) -> tuple:
    """What KV for positions [0, end) of the request depends on: its tokens and images."""
    images = tuple((f.mm_hash, f.offset) for f in request.mm_features if f.offset < end)
    return tuple(request.all_token_ids[:end]), images


@st.composite
def prompts(draw):
    tokens: list[int] = []
    features: list[MultiModalFeature] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.integers(0, 3)) == 0:
            name, length = draw(st.sampled_from([("img-a", 3), ("img-b", 2)]))
            features.append(MultiModalFeature(name, len(tokens), length, (1, 1, length)))
            tokens += [IMAGE_TOKEN] * length
        else:
            tokens += draw(st.lists(st.sampled_from([1, 2]), min_size=1, max_size=4))
    return tokens, features


class KVCacheMachine(RuleBasedStateMachine):
    """A small scheduler's worth of requests arriving, being computed in chunks (with prefix hits),
    decoding and finishing. A model records what each block holds, so a prefix hit on a block
    with other contents, or a write into a shared block, is caught."""

    NUM_BLOCKS = 10
    BS = 2

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, self.BS)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.written: dict[int, tuple] = {}  # block id → content of the positions written so far
        self.count = 0

    def _write(self, request: Request, start: int, end: int) -> None:
        blocks = self.kv.req_to_blocks[request.request_id]
        for p in range(start, end):
            block = blocks[p // self.BS]
            assert block.ref_cnt == 1, "writing into a block another request reads"
            self.written[block.block_id] = content(request, p + 1)

    def _compute(self, request: Request, n: int, hits) -> bool:
        before = snapshot(self.kv)
        start = request.num_computed_tokens + len(hits) * self.BS
        if self.kv.allocate_slots(request, n, hits) is None:
            assert snapshot(self.kv) == before
            return False
        self._write(request, start, start + n)
        request.num_computed_tokens = start + n
        return True

    @rule(prompt=prompts())
    def arrive(self, prompt):
        tokens, features = prompt
        self.waiting.append(Request(f"r{self.count}", tokens, features, SamplingParams(), self.BS))
        self.count += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), n=st.integers(1, 8))
    def admit(self, data, n):
        request = data.draw(st.sampled_from(self.waiting))
        hits, num_hit = self.kv.get_computed_blocks(request)
        event(f"prefix hit: {num_hit > 0}")
        assert num_hit == len(hits) * self.BS and num_hit < request.num_tokens
        for j, block in enumerate(hits):
            assert self.written[block.block_id] == content(request, (j + 1) * self.BS), "bad prefix hit"
        if self._compute(request, min(n, request.num_tokens - num_hit), hits):
            self.waiting.remove(request)
            self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(1, 8))
    def compute_more(self, data, n):
        request = data.draw(st.sampled_from(self.running))
        if request.num_computed_tokens == request.num_tokens:  # "sample" the next token
            seed = repr(content(request, request.num_tokens)).encode()
            request.append_output_token(1 + xxhash.xxh32_intdigest(seed) % 2)
        self._compute(request, min(n, request.num_tokens - request.num_computed_tokens), [])

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(st.sampled_from(self.running + self.waiting))
        blocks = list(self.kv.req_to_blocks.get(request.request_id, []))
        self.kv.free(request)
        released = [b.block_id for b in reversed(blocks) if b.ref_cnt == 0]
        if released:
            assert free_ids(self.kv)[-len(released) :] == released
        (self.running if request in self.running else self.waiting).remove(request)

    @invariant()
    def consistent(self):
        pool = self.kv.pool
        assert_pool_consistent(pool)
        holders = [0] * self.NUM_BLOCKS
        for request in self.running:
            blocks = self.kv.req_to_blocks[request.request_id]
            assert len(blocks) == -(-request.num_computed_tokens // self.BS)
            for b in blocks:
                holders[b.block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == holders
        assert set(self.kv.req_to_blocks) == {r.request_id for r in self.running}
        for request in self.running:  # every full block holds this request's prefix, shared or not
            blocks = self.kv.req_to_blocks[request.request_id]
            for j in range(request.num_computed_tokens // self.BS):
                assert self.written[blocks[j].block_id] == content(request, (j + 1) * self.BS)
                assert blocks[j].block_hash in (None, request.block_hashes[j])

    def teardown(self):
        for request in self.running:
            self.kv.free(request)
        assert self.kv.num_used_blocks == 0
        assert self.kv.req_to_blocks == {}
        assert_pool_consistent(self.kv.pool)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
