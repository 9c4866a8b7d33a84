"""Tensor parallelism on the CPU (gloo, one worker process per rank): greedy tokens identical to
TP=1 and to transformers in float32, for both families and both vision-tower modes, through
chunked prefill across images, prefix-cache hits and preemption; TP=3 on shapes that split over
3 ranks (its one KV head replicated on every rank)."""

from __future__ import annotations

import pytest
from engine_cases import expected_tokens
from tp_cases import ENGINE, GREEDY, SEEDED, chats, reference, reference_tokens, single_rank_tokens

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]

CASES = [("qwen2_vl", "weights"), ("qwen2_vl", "data"), ("qwen2_5_vl", "weights"), ("qwen2_5_vl", "data")]


@pytest.mark.parametrize(("family", "mode"), CASES)
def test_tp2_matches_tp1_and_transformers(family, mode):
    model_dir = checkpoint(family)
    convs = chats()
    with LLM(model_dir, tensor_parallel_size=2, mm_encoder_tp_mode=mode, **ENGINE) as llm:
        shards = llm.engine_core.executor.collective_rpc("shard_info")
        outputs = llm.chat([c[0] for c in convs], GREEDY)
        [seeded] = llm.chat(convs[0][0], SEEDED)
        # a second turn: the first turn's blocks, image included, come from the prefix cache
        messages, ref_messages, images = convs[1]
        follow_up = [
            {"role": "assistant", "content": outputs[1].outputs[0].text},
            {"role": "user", "content": "And what else do you see?"},
        ]
        encoder_runs = llm.stats().encoder_runs
        [second] = llm.chat(messages + follow_up, GREEDY)
        assert second.num_cached_tokens >= 32
        assert llm.stats().encoder_runs == encoder_runs
    tokens = [out.outputs[0].token_ids for out in outputs]
    greedy_tp1, seeded_tp1 = single_rank_tokens(model_dir)
    assert tokens == greedy_tp1
    assert tokens == reference_tokens(model_dir)
    assert seeded.outputs[0].token_ids == seeded_tp1, "every rank samples the same token"
    _, expected_second = expected_tokens(reference(model_dir), ref_messages + follow_up, images)
    assert second.outputs[0].token_ids == expected_second
    # each rank holds one of the 2 KV heads, and its share of the weights
    assert [s["num_kv_heads"] for s in shards] == [1, 1]
    assert shards[0]["kv_cache_bytes"] == shards[1]["kv_cache_bytes"]


@pytest.mark.parametrize(("family", "mode"), [("qwen2_vl", "data"), ("qwen2_5_vl", "weights")])
def test_tp2_preemption_returns_the_same_tokens(family, mode):
    model_dir = checkpoint(family)
    num, max_tokens = 8, 24
    settings = {"max_num_batched_tokens": 64, "num_kv_blocks": 24, "block_size": 16, "dtype": "float32"}
    with LLM(model_dir, tensor_parallel_size=2, mm_encoder_tp_mode=mode, **settings) as llm:
        outputs = llm.chat([c[0] for c in chats(num)], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        assert llm.stats().num_preemptions > 0
        assert llm.stats().kv_blocks_in_use == 0
    assert [o.outputs[0].token_ids for o in outputs] == reference_tokens(model_dir, num, max_tokens)


@pytest.mark.parametrize(("family", "mode"), [("qwen2_vl", "data"), ("qwen2_5_vl", "weights")])
def test_tp3_with_a_replicated_kv_head_matches_transformers(family, mode):
    model_dir = checkpoint(family, "tp3")
    num = 4
    with LLM(model_dir, tensor_parallel_size=3, mm_encoder_tp_mode=mode, **ENGINE) as llm:
        shards = llm.engine_core.executor.collective_rpc("shard_info")
        outputs = llm.chat([c[0] for c in chats(num)], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference_tokens(model_dir, num)
    assert [s["num_kv_heads"] for s in shards] == [1, 1, 1]
