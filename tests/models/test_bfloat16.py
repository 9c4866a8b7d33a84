"""bfloat16: our engine against transformers in bfloat16, within bfloat16's resolution.

Random-weight tiny models have nearly flat output distributions, so in bfloat16 two top tokens
are often within one rounding step of each other; token-exact greedy agreement is therefore
asserted in float32 (test_qwen_vl_vs_transformers.py), and here the first step's log-probs
must agree to bfloat16 precision and our greedy pick must be one of transformers' near-best.
"""

from __future__ import annotations

import torch

from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.models.registry import load_model_config
from mmserve.testing.driver import ChunkedDriver
from mmserve.testing.reference import Reference, synthetic_image
from mmserve.worker.model_runner import ModelRunner

BF16_STEP = 0.0625  # two bfloat16 rounding steps of a logit of magnitude 4–8


def test_bfloat16_first_step_agrees_with_transformers(model_dir):
    reference = Reference(model_dir, dtype=torch.bfloat16)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    prompt = reference.build_prompt(messages, [synthetic_image(200, 150, seed=1)])
    expected = reference.generate(prompt, 1)
    runner = ModelRunner(
        load_model_config(model_dir, dtype="bfloat16"),
        CacheConfig(),
        SchedulerConfig(max_num_seqs=2),
        torch.device("cpu"),
    )
    runner.initialize_kv_cache(64)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    [ours] = ChunkedDriver(runner).generate([prompt], 1, chunk_size=4096)
    want = torch.log_softmax(expected.logits[0], dim=-1)
    ids = torch.tensor(ours.logprobs[0].token_ids[0])
    got = torch.tensor(ours.logprobs[0].logprobs[0])
    # A log-prob is a logit minus the log-normaliser: the normaliser's rounding shifts every
    # entry alike (~3e-4 with oneDNN's bfloat16 matmuls), so it is taken out before the logits'
    # own differences are held to two rounding steps.
    difference = got - want[ids]
    assert (difference - difference.median()).abs().max() <= BF16_STEP
    assert want[ours.output[0]] > want.max() - BF16_STEP
