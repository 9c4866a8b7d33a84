"""The whole engine on the Triton kernels (`attention_backend="triton"`) against transformers, in
float32. Without a GPU the kernels run in Triton's interpreter, which is slow: a few short
cases on the tiny Qwen2-VL only — chunked prefill through an image, and a prefix-cache hit."""

from __future__ import annotations

import pytest

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import Reference

pytest.importorskip("triton")

from engine_cases import conversation, expected_tokens

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def tiny():
    return checkpoint("qwen2_vl")


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(
        tiny, dtype="float32", attention_backend="triton", max_num_batched_tokens=24, num_kv_blocks=256
    ) as engine:
        assert engine.engine_core.executor.runner.attention_backend.name == "triton"
        yield engine


def test_chunked_through_an_image_matches_transformers(llm, tiny):
    reference = Reference(tiny)
    messages, ref_messages, images = conversation(3, num_images=1, sizes=((112, 84),))
    [out] = llm.chat(messages, GREEDY)
    prompt_ids, tokens = expected_tokens(reference, ref_messages, images, MAX_TOKENS)
    assert len(prompt_ids) > 24  # the prompt, image included, spans several steps
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == tokens


def test_a_prefix_cache_hit_matches_transformers(llm, tiny):
    reference = Reference(tiny)
    messages, ref_messages, images = conversation(5, num_images=0)
    [first] = llm.chat(messages, GREEDY)
    follow_up = [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "Say it again."},
    ]
    [second] = llm.chat(messages + follow_up, GREEDY)
    assert second.num_cached_tokens >= 16
    ref_follow_up = [follow_up[0], {"role": "user", "content": [{"type": "text", "text": "Say it again."}]}]
    _, tokens = expected_tokens(reference, ref_messages + ref_follow_up, images, MAX_TOKENS)
    assert second.outputs[0].token_ids == tokens
