"""SamplingMetadata for the rows sampled this step, gathered from the persistent batch.

Seeded requests get a generator seeded from (seed, number of tokens generated so far), so a
seeded request's k-th token depends only on its seed and its own history: the same whatever
the batch around it, and the same after preemption and recompute.
"""

from __future__ import annotations

import numpy as np
import torch

from mmserve.layers.sampler import SamplingMetadata
from mmserve.worker.input_batch import InputBatch
from mmserve.worker.token_constraints import token_constraint_fields

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, step) pairs over the seed space


def step_seed(seed: int, num_generated: int) -> int:
    return (seed * _SEED_MIX + num_generated) % (1 << 63)


def build_sampling_metadata(
    batch: InputBatch, rows: np.ndarray, vocab_size: int, device: torch.device
) -> SamplingMetadata:
    params = [batch.states[batch.req_ids[r]].sampling_params for r in rows]
    outputs = [batch.states[batch.req_ids[r]].output_token_ids for r in rows]
    temperature = torch.tensor([0.0 if p.is_greedy else p.temperature for p in params], dtype=torch.float32)
    all_greedy = all(p.is_greedy for p in params)

    def column(values: list, dtype: torch.dtype, neutral) -> torch.Tensor | None:
        return None if all(v == neutral for v in values) else torch.tensor(values, dtype=dtype, device=device)

    generators = {
        i: torch.Generator(device=device).manual_seed(step_seed(p.seed, len(out)))
        for i, (p, out) in enumerate(zip(params, outputs))
        if p.seed is not None and not p.is_greedy
    }
    repetition = column([p.repetition_penalty for p in params], torch.float32, 1.0)
    prompt_token_ids = None
    if repetition is not None:
        lengths = batch.num_prompt_tokens[rows]
        width = int(lengths.max())
        padded = np.where(
            np.arange(width)[None, :] < lengths[:, None], batch.token_ids[rows, :width], vocab_size
        )
        prompt_token_ids = torch.from_numpy(padded).to(device)
    min_tokens = {}
    for i, (p, out) in enumerate(zip(params, outputs)):
        if len(out) < p.min_tokens:
            min_tokens[i] = (p.min_tokens, set(p.all_stop_token_ids))
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=temperature.to(device),
        all_greedy=all_greedy,
        all_random=not any(p.is_greedy for p in params),
        top_k=column([p.top_k for p in params], torch.int64, 0),
        top_p=column([p.top_p for p in params], torch.float32, 1.0),
        min_p=column([p.min_p for p in params], torch.float32, 0.0),
        generators=generators,
        presence_penalties=column([p.presence_penalty for p in params], torch.float32, 0.0),
        frequency_penalties=column([p.frequency_penalty for p in params], torch.float32, 0.0),
        repetition_penalties=repetition,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=outputs,
        min_tokens=min_tokens,
        max_num_logprobs=max(logprob_counts) if logprob_counts else None,
        **token_constraint_fields(params, outputs, vocab_size, device),
    )
