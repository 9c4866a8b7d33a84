"""The token constraints of the rows sampled this step, as SamplingMetadata fields: logit_bias,
allowed_token_ids, bad words (vLLM's semantics: a bad word's last token is banned right after
its other tokens were generated; a one-token word always) and the grammar bitmask."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmserve.core.sched_output import GrammarBitmask
from mmserve.sampling_params import SamplingParams


def token_constraint_fields(
    params: list[SamplingParams], outputs: list[list[int]], vocab_size: int, device: torch.device
) -> dict[str, Any]:
    """SamplingMetadata keyword arguments for the rows' constraints; empty when none has any."""
    if not any(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids for p in params):
        return {}
    fields: dict[str, Any] = {}
    bias = [
        (row, token, value) for row, p in enumerate(params) for token, value in (p.logit_bias or {}).items()
    ]
    if bias:
        rows, ids, values = zip(*bias)
        fields["logit_bias"] = (
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(values, dtype=torch.float32, device=device),
        )
    if any(p.allowed_token_ids for p in params):
        mask = torch.ones(len(params), vocab_size, dtype=torch.bool)  # [B, V]
        for row, p in enumerate(params):
            if p.allowed_token_ids:
                mask[row] = False
                mask[row, p.allowed_token_ids] = True
        fields["allowed_token_mask"] = mask.to(device)
    banned = [(row, token) for row, (p, out) in enumerate(zip(params, outputs)) for token in _banned(p, out)]
    if banned:
        rows, ids = zip(*banned)
        index = torch.tensor([rows, ids], dtype=torch.int64, device=device)
        fields["banned_tokens"] = (index[0], index[1])
    return fields


def _banned(params: SamplingParams, output_token_ids: list[int]) -> list[int]:
    """Tokens that would complete one of the request's bad words now."""
    return [
        word[-1]
        for word in params.bad_words_token_ids
        if len(word) == 1 or output_token_ids[-(len(word) - 1) :] == word[:-1]
    ]


def grammar_fields(
    grammar: GrammarBitmask | None, sampled_req_ids: list[str], device: torch.device
) -> dict[str, Any]:
    """The grammar bitmask laid out by batch row (xgrammar applies row i of the bitmask to row
    i of the logits; rows without a grammar allow everything) and the rows that have one."""
    if grammar is None:
        return {}
    position = {req_id: row for row, req_id in enumerate(sampled_req_ids)}
    pairs = [(i, position[req_id]) for i, req_id in enumerate(grammar.req_ids) if req_id in position]
    if not pairs:
        return {}
    source, rows = (np.array(column, dtype=np.int64) for column in zip(*pairs))
    bitmask = np.full((len(sampled_req_ids), grammar.bitmask.shape[1]), -1, dtype=np.int32)  # [B, W]
    bitmask[rows] = grammar.bitmask[source]
    return {
        "grammar_bitmask": torch.from_numpy(bitmask).to(device),
        "grammar_rows": torch.from_numpy(rows).to(device),
    }
