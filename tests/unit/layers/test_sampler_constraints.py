"""The sampler's token constraints: logit_bias, allowed_token_ids, bad words and the grammar
bitmask, applied only to the rows that carry them."""

from __future__ import annotations

import math

import torch

from mmserve.core.sched_output import GrammarBitmask
from mmserve.layers.sampler import Sampler, SamplingMetadata, apply_token_constraints
from mmserve.sampling_params import SamplingParams
from mmserve.worker.token_constraints import grammar_fields, token_constraint_fields

V = 70


def greedy(rows: int, **fields) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.zeros(rows), all_greedy=True, all_random=False, **fields)


def test_each_constraint_changes_only_its_rows():
    params = [
        SamplingParams(logit_bias={5: 100.0}),
        SamplingParams(allowed_token_ids=[7, 8]),
        SamplingParams(bad_words_token_ids=[[3], [1, 2]]),
        SamplingParams(),
    ]
    outputs = [[], [], [9, 1], []]
    logits = torch.randn(4, V)
    fields = token_constraint_fields(params, outputs, V, torch.device("cpu"))
    out = apply_token_constraints(logits.clone(), greedy(4, **fields))
    assert out[0].argmax() == 5 and out[0, 5] == logits[0, 5] + 100
    assert torch.isinf(out[1]).sum() == V - 2 and out[1, [7, 8]].isfinite().all()
    assert math.isinf(out[2, 3]) and math.isinf(out[2, 2])  # [1, 2]: 1 was just generated
    assert torch.isinf(out[2]).sum() == 2
    assert torch.equal(out[3], logits[3])


def test_no_constraint_costs_nothing():
    assert token_constraint_fields([SamplingParams()] * 3, [[]] * 3, V, torch.device("cpu")) == {}
    assert grammar_fields(None, ["a"], torch.device("cpu")) == {}


def test_the_grammar_bitmask_goes_to_its_request_rows_and_the_sampler_obeys_it():
    allowed = 42
    words = torch.zeros(1, -(-V // 32), dtype=torch.int32)
    words[0, allowed // 32] = 1 << (allowed % 32)
    bitmask = GrammarBitmask(["b"], words.numpy())
    fields = grammar_fields(bitmask, ["a", "b", "c"], torch.device("cpu"))
    assert fields["grammar_rows"].tolist() == [1]
    logits = torch.randn(3, V)
    result = Sampler()(logits, greedy(3, **fields))
    assert result.sampled_token_ids[1] == allowed
    assert result.sampled_token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    masked = apply_token_constraints(logits.clone(), greedy(3, **fields))
    assert masked[1].isfinite().nonzero().flatten().tolist() == [allowed]
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
