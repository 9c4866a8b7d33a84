"""Turn one SchedulerOutput and the persistent batch into the step's model inputs, with numpy.

Everything here is vectorised over the step's tokens except the few requests whose scheduled
span touches their images' M-RoPE table (prompt chunks before the last image ends).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmserve.layers.attention import AttentionMetadata
from mmserve.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    req_ids: list[str]  # scheduled requests, in batch-row order
    rows: np.ndarray  # [R] their batch rows
    num_scheduled: np.ndarray  # [R]
    token_index: np.ndarray  # [T] each token's index within its request's sequence
    query_start_loc: np.ndarray  # [R + 1]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [3, T]
    attn_metadata: AttentionMetadata
    sample_mask: np.ndarray  # [R] bool: the request computes its last known token this step
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to turn into logits


def prepare_step_inputs(
    batch: InputBatch, num_scheduled_tokens: dict[str, int], block_size: int, device: torch.device
) -> StepInputs:
    req_ids = sorted(num_scheduled_tokens, key=batch.row_of.__getitem__)
    rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    num_scheduled = np.fromiter(
        (num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
    )
    query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    token_row = np.repeat(rows, num_scheduled)  # [T]
    offset_in_span = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], num_scheduled)
    token_index = batch.num_computed_tokens[token_row] + offset_in_span
    input_ids = batch.token_ids[token_row, token_index]
    slot_mapping = (
        batch.block_table[token_row, token_index // block_size] * block_size + token_index % block_size
    )

    positions = np.broadcast_to(token_index + batch.mrope_delta[token_row], (3, num_tokens)).copy()
    for i in np.nonzero(batch.num_computed_tokens[rows] < batch.mm_end[rows])[0]:
        table = batch.states[req_ids[i]].mrope_positions
        start = int(batch.num_computed_tokens[rows[i]])
        end = min(start + int(num_scheduled[i]), table.shape[1])
        q0 = int(query_start_loc[i])
        positions[:, q0 : q0 + end - start] = table[:, start:end]

    seq_lens = batch.num_computed_tokens[rows] + num_scheduled
    sample_mask = seq_lens >= batch.num_tokens[rows]
    max_blocks = int(batch.num_blocks[rows].max()) if len(rows) else 0
    metadata = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(batch.block_table[rows, :max_blocks]).to(device),
        slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        max_query_len=int(num_scheduled.max()) if len(rows) else 0,
        max_seq_len=int(seq_lens.max()) if len(rows) else 0,
    )
    return StepInputs(
        req_ids=req_ids,
        rows=rows,
        num_scheduled=num_scheduled,
        token_index=token_index,
        query_start_loc=query_start_loc,
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=metadata,
        sample_mask=sample_mask,
        logits_indices=torch.from_numpy(query_start_loc[1:][sample_mask] - 1).to(device),
    )


def multimodal_scatter_plan(batch: InputBatch, inputs: StepInputs) -> list[tuple[str, int, int, int]]:
    """For every image overlapping a scheduled span: (mm_hash, first embedding row, row count,
    first destination token in the step). Parts of an image outside the span are left for the
    steps that schedule them."""
    plan = []
    for i, req_id in enumerate(inputs.req_ids):
        state = batch.states[req_id]
        start = int(batch.num_computed_tokens[inputs.rows[i]])
        end = start + int(inputs.num_scheduled[i])
        for feature in state.mm_features:
            lo, hi = max(start, feature.offset), min(end, feature.offset + feature.length)
            if lo < hi:
                plan.append(
                    (
                        feature.mm_hash,
                        lo - feature.offset,
                        hi - lo,
                        int(inputs.query_start_loc[i]) + lo - start,
                    )
                )
    return plan
