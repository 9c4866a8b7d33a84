"""Decode CUDA graphs without a GPU: the ladder, the padding, which steps qualify, and the padded
static inputs a replay reads, run through the model eagerly.

No CUDA graph is captured or replayed here (that needs a CUDA device; benchmarks/gpu_check.py
checks it). What is tested is everything around the capture: that a decode step copied into the
static buffers and padded up to a ladder size gives its real rows the same hidden states, and
writes the same KV cache, as the step run as it is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.config import CacheConfig, CompilationConfig, ExecutionConfig, SchedulerConfig
from mmserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from mmserve.layers.attention import AttentionMetadata, get_attention_backend
from mmserve.models.registry import load_model_config
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.worker.cuda_graphs import (
    StaticDecodeInputs,
    capture_sizes,
    graph_sizes,
    is_decode_only,
    padded_size,
)
from mmserve.worker.model_runner import ModelRunner

pytest.importorskip("triton")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MAX_MODEL_LEN = 1024  # the padded metadata claims it: Triton then splits the short contexts 4 ways
GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def test_the_default_ladder_is_1_2_4_then_multiples_of_8_up_to_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # the limit itself, so 17..20 find a size
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000)[-1] == 512


def test_configured_sizes_are_sorted_and_capped_at_max_num_seqs():
    assert capture_sizes(16, [8, 1, 32, 4, 4]) == [1, 4, 8]
    assert capture_sizes(16, []) == []


@pytest.mark.parametrize(("num_requests", "size"), [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (17, None)])
def test_a_step_pads_up_to_the_next_size(num_requests, size):
    assert padded_size(num_requests, [1, 2, 4, 8, 16]) == size


def test_graphs_only_on_cuda_with_a_capturable_backend_and_not_eager():
    triton = get_attention_backend("triton", CPU)
    torch_reference = get_attention_backend("torch", CPU)
    default = ExecutionConfig()
    assert graph_sizes(default, 8, triton, CUDA) == [1, 2, 4, 8]
    assert graph_sizes(default, 8, triton, CPU) == []
    assert graph_sizes(ExecutionConfig(enforce_eager=True), 8, triton, CUDA) == []
    assert graph_sizes(default, 8, torch_reference, CUDA) == []  # it reads host copies
    sized = ExecutionConfig(compilation=CompilationConfig(cudagraph_capture_sizes=(2, 6)))
    assert graph_sizes(sized, 8, triton, CUDA) == [2, 6]


def metadata_with(max_query_len: int) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(0, empty, empty, empty, empty, np.zeros(1), np.zeros(0), max_query_len, 1)


def test_only_one_text_token_per_request_is_decode_only():
    text = np.array([40, 7]), np.array([12, 0])  # token indices past each request's images
    assert is_decode_only(metadata_with(1), *text)
    assert not is_decode_only(metadata_with(2), *text)  # a prompt chunk
    assert not is_decode_only(metadata_with(1), np.array([40, 7]), np.array([12, 8]))  # an image token


def runner_after_prefill(backend: str, prompt_lens: list[int], block_ids: list[list[int]]) -> ModelRunner:
    """A runner holding requests r0, r1, ... whose prompts are computed (one step), each with
    the blocks given (ids out of order, with holes)."""
    config = load_model_config(checkpoint("qwen2_vl"), dtype="float32", max_model_len=MAX_MODEL_LEN)
    runner = ModelRunner(
        config,
        CacheConfig(num_blocks=64),
        SchedulerConfig(max_num_seqs=16, max_model_len=MAX_MODEL_LEN),
        CPU,
        ExecutionConfig(attention_backend=backend),
    )
    runner.initialize_kv_cache(64)
    rng = np.random.default_rng(0)
    new = [
        NewRequestData(f"r{i}", rng.integers(100, 2000, n).tolist(), [], GREEDY, blocks, 0)
        for i, (n, blocks) in enumerate(zip(prompt_lens, block_ids))
    ]
    scheduled = {f"r{i}": n for i, n in enumerate(prompt_lens)}
    runner.execute_model(
        SchedulerOutput(new, CachedRequestData(), scheduled, sum(prompt_lens), {}, set(), [])
    )
    return runner


def test_a_padded_decode_step_matches_the_step_as_it_is():
    """The whole model over padded static inputs, with the C++ kernels (they honour the same
    padding contract as the graph backends, and the interpreter would take minutes here)."""
    prompt_lens = [5, 20, 9]
    runner = runner_after_prefill("cpu", prompt_lens, [[7], [30, 2], [11]])
    cached = CachedRequestData(["r0", "r1", "r2"], [[], [], []], prompt_lens)
    step = SchedulerOutput([], cached, dict.fromkeys(["r0", "r1", "r2"], 1), 3, {}, set(), [])
    runner._update_states(step)
    inputs = runner.step_inputs.prepare(step.num_scheduled_tokens)
    assert is_decode_only(inputs.attn_metadata, inputs.token_index, runner.batch.mm_end[inputs.rows])
    embeds = runner._embed(inputs)
    caches_before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():  # on a clone: the kernel sets may work in place on their inputs
        expected = runner.model(embeds.clone(), inputs.positions, runner.kv_caches, inputs.attn_metadata)
    expected_caches = [c.clone() for c in runner.kv_caches]
    for cache, before in zip(runner.kv_caches, caches_before):
        cache.copy_(before)

    static = StaticDecodeInputs(
        16, embeds.shape[1], runner.max_blocks_per_req, MAX_MODEL_LEN, torch.float32, CPU, position_rows=3
    )
    static.block_table.fill_(5)  # stale ids from "earlier steps": valid blocks the kernels must not read
    static.fill(embeds, inputs.positions, inputs.attn_metadata, size=8)
    assert static.slot_mapping[3:8].eq(-1).all() and static.seq_lens[3:8].eq(1).all()
    assert static.query_start_loc[:9].tolist() == list(range(9))
    with torch.inference_mode():
        padded = runner.model(
            static.embeds[:8], static.positions[:, :8], runner.kv_caches, static.metadata(8)
        )
    torch.testing.assert_close(padded[:3], expected, rtol=1e-5, atol=1e-5)
    assert padded[3:].isfinite().all()
    for cache, want in zip(runner.kv_caches, expected_caches):
        torch.testing.assert_close(cache, want, rtol=1e-5, atol=1e-5)  # padding rows stored nothing


def test_triton_attention_over_padded_static_inputs_matches_the_real_rows():
    """The captured backend's padding: rows 3..7 of an 8-row static step store nothing and leave
    rows 0..2 as the reference computes them, though the metadata claims the model length
    (four context splits for these short contexts)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    cache = torch.randn(2, 12, block_size, kv_heads, head_dim, generator=gen)  # [2, B, S, KVH, D]
    seq_lens = torch.tensor([5, 21, 40], dtype=torch.int32)
    table = torch.tensor([[7, 0, 0], [3, 9, 0], [11, 1, 4]], dtype=torch.int32)
    positions = seq_lens.long() - 1
    slots = table[torch.arange(3), positions // block_size].long() * block_size + positions % block_size
    real = AttentionMetadata(
        num_tokens=3,
        query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slots,
        query_start_loc_cpu=np.arange(4),
        seq_lens_cpu=seq_lens.numpy(),
        max_query_len=1,
        max_seq_len=40,
    )
    q = torch.randn(8, heads, head_dim, generator=gen)
    k, v = torch.randn(2, 8, kv_heads, head_dim, generator=gen)
    expected_cache = cache.clone()
    expected = get_attention_backend("torch", CPU).forward(q[:3], k[:3], v[:3], expected_cache, real, 0.2)

    static = StaticDecodeInputs(8, 1, 4, MAX_MODEL_LEN, torch.float32, CPU, position_rows=3)
    static.fill(torch.zeros(3, 1), torch.zeros(3, 3, dtype=torch.int64), real, size=8)
    got = get_attention_backend("triton", CPU).forward(q, k, v, cache, static.metadata(8), 0.2)
    torch.testing.assert_close(got[:3], expected, rtol=1e-5, atol=1e-5)
    assert got[3:].isfinite().all()
    assert torch.equal(cache, expected_cache)
