"""The unified Triton paged-attention kernel against `reference.paged_attention`.

Batches mix decode rows, prompt chunks over a cached context and fresh prompts; their blocks are
scattered over a cache twice the size needed, table rows are padded past the context with an
unused block, and every slot no request owns holds NaN, so a read outside a context shows up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mmserve.ops import reference

pytest.importorskip("triton")
from mmserve.ops.triton import unified_attention
from mmserve.ops.triton.unified_attention import (
    MAX_KV_SPLITS,
    choose_num_kv_splits,
    choose_tiles,
    paged_attention,
)

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# (cached context tokens, query tokens) per request, chosen to hit the edges: a chunk that starts
# on a block boundary, one that ends on one, a request with no query this step, a one-token prompt.
EDGES = [(16, 5), (3, 13), (0, 1), (9, 0), (0, 7), (37, 1), (1, 1)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # ~2 ulp(1) below fp32


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, B, S, KVH, D]
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int
    max_seq_len: int

    def attend(self, **options) -> torch.Tensor:
        return paged_attention(
            self.query,
            self.kv_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.query.shape[-1] ** -0.5,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            **options,
        )

    def expected(self) -> torch.Tensor:
        return reference.paged_attention(
            self.query,
            self.kv_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_table,
            self.query.shape[-1] ** -0.5,
        )


def make_batch(
    requests: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    padding_rows: int = 0,
) -> Batch:
    """requests: (context, query) token counts; padding_rows extra query rows past the batch."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [context + queries for context, queries in requests]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 1
    free = list(rng.permutation(num_blocks))
    unused = free.pop()  # stays NaN; padding entries of the table point at it
    table = np.full((len(requests), max(blocks_needed) + 2), unused, dtype=np.int32)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    for r, (length, needed) in enumerate(zip(seq_lens, blocks_needed)):
        table[r, :needed] = [free.pop() for _ in range(needed)]
        keys_values = torch.randn(2, length, kv_heads, head_dim, generator=generator)
        for position in range(length):
            cache[:, table[r, position // block_size], position % block_size] = keys_values[:, position]
    query_lens = [queries for _, queries in requests]
    num_tokens = sum(query_lens) + padding_rows
    query = torch.randn(num_tokens, heads, head_dim, generator=generator)
    return Batch(
        query=query.to(device, dtype),
        kv_cache=cache.to(device, dtype),
        query_start_loc=torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=torch.from_numpy(table).to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def random_requests(rng: np.random.Generator, count: int, max_context: int) -> list[tuple[int, int]]:
    """A mix of decode rows, prompt chunks over a cached context and whole prompts."""
    kinds = rng.integers(0, 3, size=count)
    return [
        (int(rng.integers(1, max_context)), 1)
        if kind == 0
        else (int(rng.integers(1, max_context // 2)), int(rng.integers(2, 12)))
        if kind == 1
        else (0, int(rng.integers(2, 16)))
        for kind in kinds
    ]


def assert_matches_reference(batch: Batch, got: torch.Tensor) -> None:
    rows = int(batch.query_start_loc[-1])
    tolerance = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(got[:rows], batch.expected()[:rows], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(2, 2, 64, 16), (4, 2, 80, 32), (6, 2, 64, 16), (8, 2, 128, 64)],
)
def test_mixed_batch_matches_reference(heads, kv_heads, head_dim, block_size, device):
    """MHA and GQA ratios 2, 3 (a group that does not divide the row block) and 4; padded head dims."""
    rng = np.random.default_rng(heads)
    requests = EDGES + random_requests(rng, 3, max_context=70)
    batch = make_batch(
        requests,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        device=device,
        seed=heads,
    )
    assert_matches_reference(batch, batch.attend(num_kv_splits=1))


@pytest.mark.parametrize("max_query_len", [1, 7])
def test_half_precision_tiles_match_reference_in_float32(max_query_len, monkeypatch, device):
    """The tile shapes planned for half precision, run in float32 so they are held to float32's
    tolerance, split and unsplit, with a GQA group (7) that leaves rows of the block empty."""
    tiles = choose_tiles(7, max_query_len, torch.bfloat16)
    monkeypatch.setattr(unified_attention, "choose_tiles", lambda *_: tiles)
    requests = [(40, max_query_len), (3, 1), (0, max_query_len), (18, max_query_len)]
    batch = make_batch(
        requests, heads=7, kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, device=device, seed=9
    )
    for num_kv_splits in (1, 2):
        assert_matches_reference(batch, batch.attend(num_kv_splits=num_kv_splits))


@pytest.mark.parametrize("num_kv_splits", [2, 8])
def test_split_kv_matches_reference(num_kv_splits, device):
    """Contexts longer than the splits, and shorter (splits left empty), in one mixed batch."""
    requests = [(150, 1), (5, 1), (90, 6), (0, 3), (40, 1)]
    batch = make_batch(
        requests, heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device, seed=7
    )
    assert_matches_reference(batch, batch.attend(num_kv_splits=num_kv_splits))


@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_reference(dtype, num_kv_splits, device):
    requests = [(70, 1), (12, 9), (0, 5), (33, 1)]
    batch = make_batch(
        requests, heads=4, kv_heads=2, head_dim=80, block_size=16, dtype=dtype, device=device, seed=3
    )
    got = batch.attend(num_kv_splits=num_kv_splits)
    assert got.dtype == dtype
    assert_matches_reference(batch, got)


def test_long_decodes_split_on_their_own(device):
    """A decode-only step of a few long contexts gets split-KV from the default heuristic."""
    requests = [(700, 1), (520, 1), (64, 1)]
    batch = make_batch(
        requests, heads=4, kv_heads=2, head_dim=64, block_size=32, dtype=torch.float32, device=device, seed=11
    )
    assert choose_num_kv_splits(len(requests) * 2, batch.max_seq_len, batch.query.device) > 1
    assert_matches_reference(batch, batch.attend())


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_rows_past_the_batch_are_left_alone(num_kv_splits, device):
    """Padding rows after query_start_loc[R] (a captured graph's) are neither read nor written."""
    batch = make_batch(
        [(20, 1), (0, 4)],
        heads=4,
        kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=device,
        seed=5,
        padding_rows=3,
    )
    out = torch.full_like(batch.query, 7.0)
    batch.attend(num_kv_splits=num_kv_splits, out=out)
    assert torch.equal(out[5:], torch.full_like(out[5:], 7.0))
    assert_matches_reference(batch, out)


def test_a_step_of_padding_rows_only_writes_nothing(device):
    batch = make_batch(
        [(20, 1)], heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device, seed=1
    )
    batch.query_start_loc, batch.seq_lens = batch.query_start_loc[:1], batch.seq_lens[:0]
    batch.block_table = batch.block_table[:0]
    for num_kv_splits in (1, 2):
        out = torch.full_like(batch.query, 7.0)
        batch.attend(num_kv_splits=num_kv_splits, out=out)
        assert torch.equal(out, torch.full_like(out, 7.0))


def test_num_kv_splits_follows_grid_size():
    cpu = torch.device("cpu")
    assert choose_num_kv_splits(10_000, 100_000, cpu) == 1  # the grid fills the GPU already
    assert choose_num_kv_splits(4, 300, cpu) == 1  # too short to be worth a second kernel
    splits = choose_num_kv_splits(4, 100_000, cpu)
    assert 1 < splits <= MAX_KV_SPLITS and splits & (splits - 1) == 0


def test_rejects_what_it_cannot_run(device):
    batch = make_batch(
        [(3, 2)], heads=3, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device, seed=0
    )
    with pytest.raises(ValueError, match="kv heads"):
        batch.attend()
    batch = make_batch(
        [(3, 2)], heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device, seed=0
    )
    with pytest.raises(ValueError, match="power of two"):
        batch.attend(num_kv_splits=3)
    batch.kv_cache = batch.kv_cache.half()
    with pytest.raises(ValueError, match="but the cache is"):
        batch.attend()
