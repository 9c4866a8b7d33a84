"""SamplingMetadata for the rows sampled this step, gathered from the persistent batch.

Most of it depends only on which requests are sampled, in which order (their params and
prompts): `SamplingMetadataBuilder` builds that part once and reuses it while the batch and the
sampled rows stay the same, which in decode is step after step. What moves with every
generated token (seeded generators, min_tokens, bad words) is refreshed each step, and only
when some sampled row uses it.

Seeded requests get a generator seeded from (seed, number of tokens generated so far), so a
seeded request's k-th token depends only on its seed and its own history: the same whatever
the batch around it, and the same after preemption and recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from mmserve.layers.sampler import SamplingMetadata
from mmserve.sampling_params import SamplingParams
from mmserve.worker.input_batch import InputBatch
from mmserve.worker.token_constraints import banned_token_fields, static_constraint_fields

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, step) pairs over the seed space


def step_seed(seed: int, num_generated: int) -> int:
    return (seed * _SEED_MIX + num_generated) % (1 << 63)


@dataclass
class _RowSet:
    """What the builder keeps for one set of sampled rows: the metadata that does not change
    while the set does not, and which rows need per-step fields."""

    key: tuple[int, bytes]  # (batch version, sampled rows)
    metadata: SamplingMetadata
    params: list[SamplingParams]
    seeded: dict[int, torch.Generator]  # row -> its generator, reseeded every step
    min_tokens_rows: list[int]  # rows with min_tokens > 0
    has_bad_words: bool


class SamplingMetadataBuilder:
    """`build(rows)` → the SamplingMetadata of those batch rows for this step. The result is
    shared with later steps while the rows do not change: callers must not modify it (use
    `dataclasses.replace` to add fields)."""

    def __init__(self, batch: InputBatch, vocab_size: int, device: torch.device) -> None:
        self.batch = batch
        self.vocab_size = vocab_size
        self.device = device
        self._rows: _RowSet | None = None

    def build(self, rows: np.ndarray) -> SamplingMetadata:
        key = (self.batch.version, rows.tobytes())
        if self._rows is None or self._rows.key != key:
            self._rows = self._row_set(key, rows)
        return self._per_step(self._rows)

    def _row_set(self, key: tuple[int, bytes], rows: np.ndarray) -> _RowSet:
        params = [self.batch.states[self.batch.req_ids[r]].sampling_params for r in rows]
        return _RowSet(
            key=key,
            metadata=static_metadata(self.batch, rows, params, self.vocab_size, self.device),
            params=params,
            # one generator per seeded random row, kept with the row set and reseeded each step
            seeded={
                i: torch.Generator(device=self.device)
                for i, p in enumerate(params)
                if p.seed is not None and not p.is_greedy
            },
            min_tokens_rows=[i for i, p in enumerate(params) if p.min_tokens > 0],
            has_bad_words=any(p.bad_words_token_ids for p in params),
        )

    def _per_step(self, row_set: _RowSet) -> SamplingMetadata:
        if not (row_set.seeded or row_set.min_tokens_rows or row_set.has_bad_words):
            return row_set.metadata
        fields = per_step_fields(
            row_set.params,
            row_set.metadata.output_token_ids,
            row_set.seeded,
            row_set.min_tokens_rows,
            self.device,
        )
        return replace(row_set.metadata, **fields)


def static_metadata(
    batch: InputBatch, rows: np.ndarray, params: list[SamplingParams], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """The fields that depend only on the rows' requests (not on how far they have generated).
    `output_token_ids` holds the requests' own lists, which grow as they generate."""
    outputs = [batch.states[batch.req_ids[r]].output_token_ids for r in rows]

    def column(values: list, dtype: torch.dtype, neutral) -> torch.Tensor | None:
        return None if all(v == neutral for v in values) else torch.tensor(values, dtype=dtype, device=device)

    repetition = column([p.repetition_penalty for p in params], torch.float32, 1.0)
    prompt_token_ids = None
    if repetition is not None:
        lengths = batch.num_prompt_tokens[rows]
        width = int(lengths.max())
        padded = np.where(
            np.arange(width)[None, :] < lengths[:, None], batch.token_ids[rows, :width], vocab_size
        )
        prompt_token_ids = torch.from_numpy(padded).to(device)  # [B, P]
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    temperature = [0.0 if p.is_greedy else p.temperature for p in params]
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        all_greedy=all(p.is_greedy for p in params),
        all_random=not any(p.is_greedy for p in params),
        top_k=column([p.top_k for p in params], torch.int64, 0),
        top_p=column([p.top_p for p in params], torch.float32, 1.0),
        min_p=column([p.min_p for p in params], torch.float32, 0.0),
        presence_penalties=column([p.presence_penalty for p in params], torch.float32, 0.0),
        frequency_penalties=column([p.frequency_penalty for p in params], torch.float32, 0.0),
        repetition_penalties=repetition,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=outputs,
        max_num_logprobs=max(logprob_counts) if logprob_counts else None,
        **static_constraint_fields(params, vocab_size, device),
    )


def per_step_fields(
    params: list[SamplingParams],
    outputs: list[list[int]],
    seeded: dict[int, torch.Generator],
    min_tokens_rows: list[int],
    device: torch.device,
) -> dict[str, Any]:
    """The fields that move with every generated token: each seeded row's generator reseeded
    for its next token, the rows still short of their min_tokens, the bad words' banned tokens."""
    for i, generator in seeded.items():
        generator.manual_seed(step_seed(params[i].seed, len(outputs[i])))
    min_tokens = {
        i: (params[i].min_tokens, set(params[i].all_stop_token_ids))
        for i in min_tokens_rows
        if len(outputs[i]) < params[i].min_tokens
    }
    return {
        "generators": dict(seeded),
        "min_tokens": min_tokens,
        **banned_token_fields(params, outputs, device),
    }
