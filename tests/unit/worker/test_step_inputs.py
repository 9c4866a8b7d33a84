"""The step's inputs, built into persistent buffers: equal to a token-by-token reference over
random ragged steps (unscheduled rows, rows moved by removals, chunks through images, block
tables with holes), with M-RoPE's three position rows and RoPE's one, and written in place step
after step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.models.family import PromptPositions
from mmserve.models.qwen2_vl.positions import MRopePositions
from mmserve.protocol import MultiModalFeature
from mmserve.sampling_params import SamplingParams
from mmserve.worker.input_batch import InputBatch, new_request_state
from mmserve.worker.step_inputs import PersistentBuffer, StepInputBuilder

BLOCK_SIZE = 4
MAX_LEN = 64
MERGE = 2
CPU = torch.device("cpu")
SCHEMES = {"mrope": MRopePositions(MERGE), "rope": PromptPositions()}


def add_request(
    batch: InputBatch, rng: np.random.Generator, req_id: str, positions: PromptPositions = SCHEMES["mrope"]
) -> None:
    """A request with a random prompt, an image of 4 placeholder tokens in about half of them,
    a few computed tokens and its blocks scattered over the cache (holes between them)."""
    num_prompt = int(rng.integers(6, 30))
    features = []
    if rng.random() < 0.5:
        offset = int(rng.integers(1, num_prompt - 4))
        features.append(MultiModalFeature(f"{req_id}-image", offset, 4, (1, 4, 4)))
    output = rng.integers(0, 1000, int(rng.integers(0, 3))).tolist()
    state = new_request_state(
        req_id, rng.integers(0, 1000, num_prompt).tolist(), output, features, SamplingParams(), positions
    )
    num_computed = int(rng.integers(0, state.num_tokens))
    num_blocks = -(-MAX_LEN // BLOCK_SIZE)
    blocks = rng.choice(1000, num_blocks, replace=False).tolist()
    batch.add(state, num_computed, blocks)


def random_schedule(batch: InputBatch, rng: np.random.Generator) -> dict[str, int]:
    """Some of the batch's requests, each with 1 .. its remaining tokens."""
    scheduled = {}
    for req_id in batch.req_ids:
        row = batch.row_of[req_id]
        remaining = int(batch.num_tokens[row] - batch.num_computed_tokens[row])
        if remaining > 0 and rng.random() < 0.8:
            scheduled[req_id] = int(rng.integers(1, remaining + 1))
    return scheduled


def reference(batch: InputBatch, scheduled: dict[str, int], rows: int) -> dict[str, list]:
    """The inputs token by token, straight from their definitions."""
    ref = {key: [] for key in ("input_ids", "positions", "slots", "seq_lens", "logits_indices")}
    token = 0
    for req_id in sorted(scheduled, key=batch.row_of.__getitem__):
        row, state = batch.row_of[req_id], batch.states[req_id]
        start = int(batch.num_computed_tokens[row])
        for index in range(start, start + scheduled[req_id]):
            ref["input_ids"].append(int(batch.token_ids[row, index]))
            table = state.positions
            inside = table is not None and index < table.shape[1]
            ref["positions"].append(
                table[:, index].tolist() if inside else [index + state.position_delta] * rows
            )
            block = int(batch.block_table[row, index // BLOCK_SIZE])
            ref["slots"].append(block * BLOCK_SIZE + index % BLOCK_SIZE)
            token += 1
        seq_len = start + scheduled[req_id]
        ref["seq_lens"].append(seq_len)
        if seq_len >= batch.num_tokens[row]:
            ref["logits_indices"].append(token - 1)
    return ref


def check(batch: InputBatch, builder: StepInputBuilder, scheduled: dict[str, int]) -> None:
    inputs = builder.prepare(scheduled)
    ref = reference(batch, scheduled, builder.position_rows)
    meta = inputs.attn_metadata
    assert inputs.input_ids.tolist() == ref["input_ids"]
    assert inputs.positions.T.tolist() == ref["positions"]
    assert meta.slot_mapping.tolist() == ref["slots"]
    assert meta.seq_lens.tolist() == ref["seq_lens"] == meta.seq_lens_cpu.tolist()
    assert inputs.logits_indices.tolist() == ref["logits_indices"]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu.tolist()
    assert meta.query_start_loc.tolist()[-1] == meta.num_tokens == len(ref["input_ids"])
    for r, row in enumerate(inputs.rows):
        num_blocks = -(-ref["seq_lens"][r] // BLOCK_SIZE)
        assert meta.block_table[r, :num_blocks].tolist() == batch.block_table[row, :num_blocks].tolist()
    assert meta.block_table.is_contiguous() and inputs.positions.is_contiguous()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("seed", range(12))
def test_step_inputs_match_the_token_by_token_reference(seed, scheme):
    rng = np.random.default_rng(seed)
    positions = SCHEMES[scheme]
    batch = InputBatch(6, MAX_LEN, -(-MAX_LEN // BLOCK_SIZE))
    # max_num_tokens 8: steps outgrow the buffers
    builder = StepInputBuilder(batch, BLOCK_SIZE, max_num_tokens=8, device=CPU, position_rows=positions.rows)
    for i in range(6):
        add_request(batch, rng, f"r{i}", positions)
    for step in range(6):
        if step == 3:  # the last row moves into the hole
            batch.remove(batch.req_ids[int(rng.integers(0, batch.num_reqs - 1))])
        scheduled = random_schedule(batch, rng)
        if not scheduled:
            continue
        check(batch, builder, scheduled)
        for req_id, n in scheduled.items():
            batch.num_computed_tokens[batch.row_of[req_id]] += n


def test_decode_steps_write_the_same_buffers_in_place():
    rng = np.random.default_rng(0)
    batch = InputBatch(4, MAX_LEN, -(-MAX_LEN // BLOCK_SIZE))
    builder = StepInputBuilder(batch, BLOCK_SIZE, max_num_tokens=64, device=CPU, position_rows=3)
    for i in range(4):
        add_request(batch, rng, f"r{i}")
    storage = None
    for _ in range(3):
        for row in range(batch.num_reqs):  # every request decodes its next token
            batch.append_token(row, int(rng.integers(0, 1000)))
            batch.num_computed_tokens[row] = batch.num_tokens[row] - 1
        inputs = builder.prepare(dict.fromkeys(batch.req_ids, 1))
        meta = inputs.attn_metadata
        tensors = (
            inputs.input_ids,
            inputs.positions,
            inputs.logits_indices,
            meta.slot_mapping,
            meta.seq_lens,
        )
        pointers = [t.untyped_storage().data_ptr() for t in tensors]
        assert storage is None or pointers == storage
        storage = pointers
        assert inputs.input_ids.tolist() == [
            int(batch.token_ids[r, batch.num_tokens[r] - 1]) for r in range(4)
        ]


def test_a_buffer_grows_when_a_step_needs_more():
    buffer = PersistentBuffer(4, torch.int64, CPU)
    buffer.host(3)[:] = [1, 2, 3]
    assert buffer.device(3).tolist() == [1, 2, 3]
    grown = buffer.host(2, 5)
    grown[:] = np.arange(10).reshape(2, 5)
    assert buffer.device(2, 5).tolist() == np.arange(10).reshape(2, 5).tolist()
    assert len(buffer.host_array) >= 10
