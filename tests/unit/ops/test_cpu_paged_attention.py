"""The C++ paged attention kernel against mmserve.ops.reference.paged_attention.

Random mixed steps (decode rows, whole prompts, prompt chunks that are the tail of a longer
context, requests with no query this step) over block tables with holes: ids drawn from a
larger pool in random order, unused ids, and padding entries past each context that point
outside the cache (so a kernel reading them would fail the bounds check or read garbage).
The suite runs with 2 torch threads (tests/conftest.py), and every test once more with every
region parallel (conftest.py here), so contexts past a few hundred keys take the split-KV path
with its merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pytest
import torch

from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.attention.torch_backend import TorchAttentionBackend
from mmserve.ops import cpu, reference

pytestmark = pytest.mark.usefixtures("parallel_threshold")

FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
PROMPT_ATTENTION_MIN_QUERIES = cpu.prompt_attention_min_queries()  # longer chunks: torch's flash kernel
# One bfloat16 ulp of the result: both sides round the same float32 value, which may differ in
# its last float32 bits, to bfloat16.
BF16_TOLERANCE = {"rtol": 2**-7, "atol": 1e-5}


@dataclass
class Step:
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, B, S, KVH, D]
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32


def random_lengths(rng: np.random.Generator, max_context: int) -> tuple[int, int]:
    """(queries, context) of one request: a decode row, a whole prompt, a chunk or nothing."""
    context = int(rng.integers(1, max_context + 1))
    kind = rng.choice(["decode", "prompt", "chunk", "idle"], p=[0.4, 0.2, 0.3, 0.1])
    if kind == "decode":
        return 1, context
    if kind == "prompt":
        return context, context
    if kind == "chunk":
        return int(rng.integers(1, context + 1)), context
    return 0, context


def random_step(
    rng: np.random.Generator,
    heads: tuple[int, int],
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    max_context: int = 160,
    lengths: list[tuple[int, int]] | None = None,
) -> Step:
    """`lengths`: each request's (queries, context); random (random_lengths) when None."""
    num_heads, num_kv_heads = heads
    if lengths is None:
        lengths = [random_lengths(rng, max_context) for _ in range(int(rng.integers(1, 7)))]
    needed = [-(-context // block_size) for _, context in lengths]
    num_blocks = sum(needed) + int(rng.integers(1, 9))  # some ids stay unused
    ids = iter(rng.permutation(num_blocks).tolist())
    width = max(needed) + 3
    # padding past each context: ids outside the cache, which the kernel must never follow
    table = torch.full((len(lengths), width), num_blocks + 1000, dtype=torch.int32)
    table[:, -1] = -1
    for r, count in enumerate(needed):
        table[r, :count] = torch.tensor([next(ids) for _ in range(count)], dtype=torch.int32)
    starts = np.concatenate([[0], np.cumsum([queries for queries, _ in lengths])])
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    return Step(
        query=torch.randn(int(starts[-1]), num_heads, head_dim, generator=generator).to(dtype),
        kv_cache=torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(
            dtype
        ),
        query_start_loc=torch.from_numpy(starts).int(),
        seq_lens=torch.tensor([context for _, context in lengths], dtype=torch.int32),
        block_table=table,
    )


def rows_with_rounded_probabilities(step: Step) -> torch.Tensor:
    """[T] bool: the bfloat16 query rows whose P·V multiplies probabilities rounded to bfloat16:
    those of requests long enough for torch's flash kernel, and, on builds with AVX512-BF16
    (cpu.bf16_dot_products), decode rows (one query) whose head_dim is a multiple of 32, which
    take vdpbf16ps for both products."""
    starts = step.query_start_loc.tolist()
    dot_decode = cpu.bf16_dot_products() and step.query.shape[-1] % 32 == 0
    rows = torch.zeros(step.query.shape[0], dtype=torch.bool)
    for begin, end in pairwise(starts):
        rows[begin:end] = end - begin >= PROMPT_ATTENTION_MIN_QUERIES or (dot_decode and end - begin == 1)
    return rows


def check(step: Step, scale: float = 0.125) -> None:
    got = cpu.paged_attention(
        step.query, step.kv_cache, step.query_start_loc, step.seq_lens, step.block_table, scale
    )
    want = reference.paged_attention(
        step.query, step.kv_cache, step.query_start_loc, step.seq_lens, step.block_table, scale
    )
    if step.query.dtype == torch.float32 and step.kv_cache.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOLERANCE)
        return
    rounded = rows_with_rounded_probabilities(step)
    torch.testing.assert_close(got[~rounded], want[~rounded], **BF16_TOLERANCE)
    # Probabilities rounded to bfloat16 (relative error 2^-9 each) against a float32 normaliser
    # move a row by up to 2^-9 · max|v|; the logic these rows share with float32 is held to 1e-5
    # there.
    atol = 2**-8 * step.kv_cache[1].abs().max().item()
    torch.testing.assert_close(got[rounded], want[rounded], rtol=2**-7, atol=atol)


# (query heads, kv heads), head_dim, block size: GQA ratios 1, 2, 4, 6, 7; dims 32–256.
SHAPES = [
    ((4, 4), 32, 8),
    ((8, 4), 64, 16),
    ((8, 2), 80, 32),
    ((12, 2), 128, 16),
    ((14, 2), 128, 8),
    ((7, 1), 256, 32),
    ((4, 1), 36, 16),  # head_dim not a multiple of the vector width (8 or 16 floats): scalar tails
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), SHAPES)
def test_random_mixed_steps_match_reference(heads, head_dim, block_size, dtype):
    rng = np.random.default_rng([head_dim, block_size, heads[0], heads[1]])
    for _ in range(4):
        check(random_step(rng, heads, head_dim, block_size, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), SHAPES)
def test_long_prompts_and_chunks_match_reference(heads, head_dim, block_size, dtype):
    """Requests long enough for torch's flash kernel beside decode rows and short chunks:
    whole prompts (SDPA's causal flag) and chunks after cached keys (a mask), at the threshold."""
    rng = np.random.default_rng([7, head_dim, block_size, heads[0]])
    for _ in range(2):
        long_queries = PROMPT_ATTENTION_MIN_QUERIES + int(rng.integers(0, 170))
        lengths = [
            (long_queries, long_queries),  # a whole prompt, then a chunk after cached keys
            (PROMPT_ATTENTION_MIN_QUERIES, PROMPT_ATTENTION_MIN_QUERIES + int(rng.integers(1, 200))),
            (1, int(rng.integers(1, 400))),  # a decode row
            (PROMPT_ATTENTION_MIN_QUERIES - 1, PROMPT_ATTENTION_MIN_QUERIES + 170),  # just short of it
        ]
        order = rng.permutation(len(lengths))
        check(random_step(rng, heads, head_dim, block_size, dtype, lengths=[lengths[i] for i in order]))


def step_of(
    rng: np.random.Generator,
    lengths: list[tuple[int, int]],  # (queries, context) per request
    heads: tuple[int, int],
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
) -> Step:
    """A step of the given requests over a shuffled cache; table padding points outside it."""
    needed = [-(-context // block_size) for _, context in lengths]
    num_blocks = sum(needed) + 5
    ids = iter(rng.permutation(num_blocks).tolist())
    table = torch.full((len(lengths), max(needed) + 1), -7, dtype=torch.int32)
    for r, count in enumerate(needed):
        table[r, :count] = torch.tensor([next(ids) for _ in range(count)], dtype=torch.int32)
    starts = np.concatenate([[0], np.cumsum([q for q, _ in lengths])])
    generator = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    return Step(
        query=torch.randn(int(starts[-1]), heads[0], head_dim, generator=generator).to(dtype),
        kv_cache=torch.randn(2, num_blocks, block_size, heads[1], head_dim, generator=generator).to(dtype),
        query_start_loc=torch.from_numpy(starts).int(),
        seq_lens=torch.tensor([c for _, c in lengths], dtype=torch.int32),
        block_table=table,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_are_split_and_merged(dtype):
    """One long decode row and one chunk at the end of a long context: items far above a core's
    share, so their keys are split; a tiny request keeps the batch ragged."""
    rng = np.random.default_rng(7)
    check(step_of(rng, [(1, 3000), (40, 1500), (1, 5)], (8, 2), 64, dtype))


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """Runs a test with 1 torch thread (no split: a whole context per item) and with 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# (query heads, kv heads), head_dim: GQA ratios whose heads take 1, 2 or 3 passes of up to 3
# heads (1, 3, 4 = 2 + 2, 5 = 3 + 2, 8 = 3 + 3 + 2), dims with and without scalar tails.
DECODE_SHAPES = [((4, 4), 32), ((12, 4), 64), ((8, 2), 40), ((10, 2), 128), ((8, 1), 36), ((12, 2), 256)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), DECODE_SHAPES)
def test_decode_batches_of_very_different_lengths(heads, head_dim, dtype, threads):
    """Decode rows only (the decode path): contexts on either side of its 32-key steps, of the
    16-key blocks and of the 64-key split alignment, a long row that is split across threads
    while short ones are not, and a chunk in the same step."""
    rng = np.random.default_rng([heads[0], heads[1], head_dim, threads])
    contexts = [1, 2, 31, 32, 33, 63, 64, 65, 300, 513, 2100]
    lengths = [(1, c) for c in rng.permutation(contexts).tolist()] + [(3, 70)]
    check(step_of(rng, lengths, heads, head_dim, dtype))


@pytest.mark.parametrize(("heads", "head_dim"), DECODE_SHAPES)
def test_bfloat16_decode_rows_at_a_scale_that_is_not_a_power_of_two(heads, head_dim, threads):
    """On AVX512-BF16 builds bfloat16 decode scores are q · k on vdpbf16ps with the scale applied
    to the sum (head_dim a multiple of 32): a scale that rounds when folded into the query
    element by element must still give the reference's rows."""
    rng = np.random.default_rng([head_dim, threads, 11])
    lengths = [(1, c) for c in (1, 33, 300, 1100)]
    check(step_of(rng, lengths, heads, head_dim, torch.bfloat16), scale=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context", [255, 256, 257, 511, 512, 513, 1024, 1025])
def test_one_long_decode_row_split_at_every_boundary(context, dtype, threads):
    """Batch 1: the whole step is one context, split across the threads at 64-key multiples."""
    rng = np.random.default_rng(context)
    check(step_of(rng, [(1, context)], (12, 4), 64, dtype))


def test_mixed_query_and_cache_dtypes():
    rng = np.random.default_rng(3)
    step = random_step(rng, (8, 2), 64, 16, torch.float32)
    step.kv_cache = step.kv_cache.bfloat16()
    check(step)
    step.query = step.query.bfloat16()
    step.kv_cache = step.kv_cache.float()
    check(step)


def test_strided_query_rows_and_preallocated_out():
    """q as a view into a fused qkv projection; out rows past the last request stay untouched."""
    rng = np.random.default_rng(11)
    step = random_step(rng, (8, 2), 64, 16, torch.float32)
    num_tokens = step.query.shape[0]
    qkv = torch.randn(num_tokens + 2, 12, 64)  # [T + 2 padding rows, H + 2 * KVH, D]
    qkv[:num_tokens, :8] = step.query
    query = qkv[:, :8]
    out = torch.full((num_tokens + 2, 8, 64), 5.0)
    cpu.paged_attention(
        query, step.kv_cache, step.query_start_loc, step.seq_lens, step.block_table, 0.125, out=out
    )
    want = reference.paged_attention(
        step.query, step.kv_cache, step.query_start_loc, step.seq_lens, step.block_table, 0.125
    )
    torch.testing.assert_close(out[:num_tokens], want, **FP32_TOLERANCE)
    assert torch.all(out[num_tokens:] == 5.0)


def test_agrees_with_the_engine_backend():
    """Same step through TorchAttentionBackend (which also writes k/v) and write_kv + the kernel."""
    rng = np.random.default_rng(5)
    step = random_step(rng, (8, 2), 64, 16, torch.float32)
    num_tokens = step.query.shape[0]
    starts = step.query_start_loc.numpy().astype(np.int64)
    seq_lens = step.seq_lens.numpy().astype(np.int64)
    positions = np.concatenate(
        [np.arange(s - (b - a), s) for a, b, s in zip(starts[:-1], starts[1:], seq_lens)]
    )
    owners = np.repeat(np.arange(len(seq_lens)), np.diff(starts))
    blocks = step.block_table.numpy()[owners, positions // 16]
    slots = torch.from_numpy(blocks.astype(np.int64) * 16 + positions % 16)
    k, v = torch.randn(num_tokens, 2, 64), torch.randn(num_tokens, 2, 64)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=step.query_start_loc,
        seq_lens=step.seq_lens,
        block_table=step.block_table.clamp(0, step.kv_cache.shape[1] - 1),  # the torch path gathers padding
        slot_mapping=slots,
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        max_query_len=int(np.diff(starts).max()),
        max_seq_len=int(seq_lens.max()),
    )
    engine_cache = step.kv_cache.clone()
    active = np.diff(starts) > 0
    want = TorchAttentionBackend().forward(step.query, k, v, engine_cache, meta, 0.125)
    cpu.write_kv(k, v, step.kv_cache, slots)
    got = cpu.paged_attention(
        step.query, step.kv_cache, step.query_start_loc, step.seq_lens, step.block_table, 0.125
    )
    assert torch.equal(step.kv_cache, engine_cache)
    rows = torch.from_numpy(np.repeat(active, np.diff(starts)))
    torch.testing.assert_close(got[rows], want[rows], **FP32_TOLERANCE)


def test_block_id_outside_the_cache_is_rejected():
    rng = np.random.default_rng(1)
    step = random_step(rng, (4, 2), 32, 8, torch.float32)
    request = int(np.flatnonzero(np.diff(step.query_start_loc.numpy()) > 0)[0])
    step.block_table[request, 0] = step.kv_cache.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        check(step)


def test_context_shorter_than_its_queries_is_rejected():
    step = random_step(np.random.default_rng(2), (4, 2), 32, 8, torch.float32)
    request = int(np.flatnonzero(np.diff(step.query_start_loc.numpy()) > 0)[0])
    step.seq_lens[request] = int(step.query_start_loc[request + 1] - step.query_start_loc[request]) - 1
    with pytest.raises(RuntimeError, match="queries but a context of"):
        check(step)
