"""torch.compile of the language model (`compilation_config={"level": 1}`) on the CPU: the same
greedy tokens as the eager engine, and one compile serving steps of every size."""

from __future__ import annotations

import pytest
import torch
from engine_cases import conversation

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def tokens(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(range(300 + 5 * i, 313 + 11 * i))} for i in range(5)]
    texts = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    chats = llm.chat([conversation(i, num_images=1, sizes=((112, 84),))[0] for i in range(2)], GREEDY)
    return [*texts, *(chat.outputs[0].token_ids for chat in chats)]


def test_the_compiled_language_model_gives_the_eager_tokens():
    options = dict(dtype="float32", max_num_batched_tokens=48, num_kv_blocks=256)
    with LLM(checkpoint("qwen2_vl"), **options) as eager:
        expected = tokens(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with LLM(checkpoint("qwen2_vl"), compilation_config={"level": 1}, **options) as compiled:
        language_model = compiled.engine_core.executor.runner.model.model
        assert language_model._compiled_call_impl is not None
        got = tokens(compiled)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert got == expected
    # Prompt chunks of many sizes and decode batches of 1..7 rows: a graph per step size would
    # be dozens; dynamic shapes keep it to a few (size-1 specialisation, then symbolic sizes).
    assert 1 <= frames <= 4
