"""Prompt logprobs (SamplingParams.prompt_logprobs): how likely the model found each prompt
token given the ones before it, from the hidden states the step computed anyway.

Position p scores prompt token p + 1, so a step that computes prompt positions [start, end)
scores those below num_prompt_tokens - 1 (the last prompt position predicts the first output
token, which is sampling's business). Logprobs are the log-softmax of the raw logits, as for
sampled tokens.
"""

from __future__ import annotations

import torch

from mmserve.core.sched_output import LogprobsLists
from mmserve.worker.input_batch import InputBatch
from mmserve.worker.step_inputs import StepInputs

CHUNK_TOKENS = 256  # positions turned into logits at once: [256, V] float32 at a time


def compute_prompt_logprobs(
    compute_logits, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor, req_ids: set[str]
) -> dict[str, tuple[int, LogprobsLists]]:
    """request id → (first position scored, logprobs) for the requests in `req_ids` (those
    asking for prompt logprobs) whose prompt this step computed part of. Call before the
    batch's computed-token counts advance past the step."""
    results = {}
    for i, req_id in enumerate(inputs.req_ids):
        if req_id not in req_ids:
            continue
        row = int(inputs.rows[i])
        start = int(batch.num_computed_tokens[row])
        end = min(start + int(inputs.num_scheduled[i]), int(batch.num_prompt_tokens[row]) - 1)
        if end <= start:
            continue
        first = int(inputs.query_start_loc[i])
        targets = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1]).to(hidden.device)  # [L]
        num_top = batch.states[req_id].sampling_params.prompt_logprobs or 0
        pieces = [
            _score(compute_logits(hidden[first + lo : first + hi]), targets[lo:hi], num_top)
            for lo, hi in _chunks(end - start)
        ]
        results[req_id] = (start, _concat(pieces))
    return results


def _chunks(length: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + CHUNK_TOKENS, length)) for lo in range(0, length, CHUNK_TOKENS)]


def _score(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> LogprobsLists:
    logprobs = logits.float().log_softmax(dim=-1)  # [L, V]
    target_logprobs = logprobs.gather(1, targets[:, None])  # [L, 1]
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1  # [L]
    ids, values = targets[:, None], target_logprobs
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [L, k]
        ids, values = torch.cat([ids, top_ids], dim=1), torch.cat([values, top_values], dim=1)
    return LogprobsLists(ids.tolist(), values.tolist(), ranks.tolist())


def _concat(pieces: list[LogprobsLists]) -> LogprobsLists:
    return LogprobsLists(
        [row for piece in pieces for row in piece.token_ids],
        [row for piece in pieces for row in piece.logprobs],
        [rank for piece in pieces for rank in piece.sampled_ranks],
    )
