"""Shared pieces of the tensor-parallel tests: engine settings, and the transformers and TP=1
results each case is compared with (computed once per model folder)."""

from __future__ import annotations

import functools
from pathlib import Path

from engine_cases import MAX_TOKENS, conversation, expected_tokens

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import Reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=MAX_TOKENS)
# a step budget smaller than an image's tokens: prefill is chunked through the images
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32, "num_kv_blocks": 256}
NUM_CHATS = 6


def chats(num: int = NUM_CHATS) -> list:
    return [conversation(i, num_images=i % 3) for i in range(num)]


@functools.cache
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@functools.cache
def reference_tokens(model_dir: Path, num: int = NUM_CHATS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    ref = reference(model_dir)
    return [expected_tokens(ref, r, images, max_tokens)[1] for _, r, images in chats(num)]


@functools.cache
def single_rank_tokens(model_dir: Path) -> tuple[list[list[int]], list[int]]:
    """TP=1's greedy tokens for `chats()` and its seeded sample of the first chat."""
    with LLM(model_dir, **ENGINE) as llm:
        greedy = [out.outputs[0].token_ids for out in llm.chat([c[0] for c in chats()], GREEDY)]
        [seeded] = llm.chat(chats(1)[0][0], SEEDED)
    return greedy, seeded.outputs[0].token_ids
