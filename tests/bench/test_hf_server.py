"""The transformers baseline's static batching (left padding) against one prompt at a time."""

from __future__ import annotations

import asyncio

import torch

from mmserve.bench.hf_server import HFEngine, Job, parse_messages
from mmserve.bench.workload import jpeg_data_url, user_message
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import synthetic_image

MAX_TOKENS = 6


def _generate(engine: HFEngine, prompts, groups: list[list[int]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        out = []
        for group in groups:
            jobs = [Job(prompts[i], MAX_TOKENS, False, asyncio.Queue(), loop) for i in group]
            await asyncio.to_thread(engine.generate, jobs)
            for job in jobs:
                tokens = []
                while (token := job.tokens.get_nowait()) is not None:
                    tokens.append(token)
                out.append(tokens)
        return out

    return asyncio.run(run())


def test_static_batch_gives_each_prompt_the_tokens_it_gets_alone():
    engine = HFEngine(str(checkpoint("qwen2_vl", "tiny")), torch.float32, max_batch_size=3, batch_wait_s=0.0)
    messages = [
        [user_message("What is this?", [jpeg_data_url(synthetic_image(120, 90, seed=1))])],
        [
            user_message(
                "Describe the picture in detail, please.", [jpeg_data_url(synthetic_image(64, 200, seed=2))]
            )
        ],
        [{"role": "user", "content": "No image here."}],
    ]
    prompts = [engine.ref.build_prompt(*parse_messages(m)) for m in messages]
    assert len({len(p.token_ids) for p in prompts}) == 3  # different lengths: padding matters
    alone = _generate(engine, prompts, [[0], [1], [2]])
    batched = _generate(engine, prompts, [[0, 1, 2]])
    assert batched == alone
    assert all(1 <= len(tokens) <= MAX_TOKENS for tokens in alone)  # each row stops at its own limit
