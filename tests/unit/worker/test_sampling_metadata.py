"""Sampling metadata kept across steps: the same object while the sampled rows do not change,
rebuilt when they do, and every step equal to metadata built from scratch (seeded
generators, min_tokens and bad words follow the tokens generated)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.layers.sampler import Sampler
from mmserve.models.family import PromptPositions
from mmserve.sampling_params import SamplingParams
from mmserve.worker.input_batch import InputBatch, new_request_state
from mmserve.worker.sampling_metadata import SamplingMetadataBuilder

V = 50
CPU = torch.device("cpu")

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5, seed=7),
    SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
    SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.3, bad_words_token_ids=[[4, 5]]),
]


def make_batch(params: list[SamplingParams]) -> InputBatch:
    batch = InputBatch(len(params) + 1, 32, 8)
    for i, p in enumerate(params):
        state = new_request_state(f"r{i}", [1 + i, 2, 3, 4], [], [], p, PromptPositions())
        batch.add(state, 3, [i])
    return batch


def comparable(metadata) -> dict:
    """The metadata's fields as plain values (tensors as lists, generators by their state)."""
    out = {}
    for name, value in vars(metadata).items():
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        elif isinstance(value, tuple):
            value = tuple(v.tolist() for v in value)
        elif name == "generators":
            value = {row: g.get_state().tolist() for row, g in value.items()}
        out[name] = value
    return out


def test_reused_while_the_rows_stay_and_equal_to_a_fresh_build_every_step():
    batch = make_batch(PARAMS)
    builder = SamplingMetadataBuilder(batch, V, CPU)
    rows = np.arange(len(PARAMS))
    first = builder.build(rows)
    for step in range(4):
        metadata = builder.build(rows)
        fresh = SamplingMetadataBuilder(batch, V, CPU).build(rows)
        assert comparable(metadata) == comparable(fresh)
        assert metadata.temperature is first.temperature  # the fixed part was not rebuilt
        assert (2 in metadata.min_tokens) == (step < 2)
        banned = metadata.banned_tokens
        assert (banned is not None) == (batch.states["r3"].output_token_ids[-1:] == [4])
        for row in range(batch.num_reqs):
            batch.append_token(row, 4 if row == 3 and step % 2 == 0 else 10 + step)


def test_an_all_greedy_batch_without_per_step_fields_gets_the_same_object():
    batch = make_batch([SamplingParams(temperature=0.0)] * 3)
    builder = SamplingMetadataBuilder(batch, V, CPU)
    rows = np.arange(3)
    first = builder.build(rows)
    batch.append_token(0, 9)
    assert builder.build(rows) is first
    assert first.all_greedy and first.top_k is None and first.generators == {}


def test_rebuilt_when_the_sampled_rows_or_the_batch_change():
    batch = make_batch(PARAMS)
    builder = SamplingMetadataBuilder(batch, V, CPU)
    both = builder.build(np.array([0, 1]))
    only_first = builder.build(np.array([0]))
    assert only_first.temperature.tolist() == [0.0]
    batch.remove("r0")  # r3 moves into row 0
    moved = builder.build(np.array([0, 1]))
    assert moved.temperature.tolist() == pytest.approx([1.0, 0.8])
    assert both.temperature.tolist() == pytest.approx([0.0, 0.8])


def test_a_seeded_row_draws_the_same_tokens_from_a_kept_builder_as_from_fresh_ones():
    batch = make_batch([SamplingParams(temperature=1.0, seed=3)] * 2)
    kept = SamplingMetadataBuilder(batch, V, CPU)
    rows = np.arange(2)
    logits = torch.randn(2, V)
    for _ in range(3):
        token = Sampler()(logits, kept.build(rows)).sampled_token_ids
        again = Sampler()(logits, SamplingMetadataBuilder(batch, V, CPU).build(rows)).sampled_token_ids
        assert token.tolist() == again.tolist()
        for row in range(2):
            batch.append_token(row, int(token[row]))
