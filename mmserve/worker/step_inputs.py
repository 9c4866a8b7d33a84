"""Turn one SchedulerOutput and the persistent batch into the step's model inputs, with numpy.

The inputs live in buffers allocated once per runner (`PersistentBuffer`) and are written in
place every step: a step creates no input tensors, only views of the first T tokens / R
requests of each buffer (on an accelerator, each buffer also has a device twin filled by one
non-blocking copy). Everything is vectorised over the step's tokens except the few requests
whose scheduled span touches their prompt's position table (prompt chunks before the last item
ends, in families whose items have positions of their own, such as M-RoPE's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.layers.attention import AttentionMetadata
from mmserve.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    """One step's inputs. The tensors are views of the builder's buffers: valid until the next
    step is prepared, which rewrites them."""

    req_ids: list[str]  # scheduled requests, in batch-row order
    rows: np.ndarray  # [R] their batch rows
    num_scheduled: np.ndarray  # [R]
    token_index: np.ndarray  # [T] each token's index within its request's sequence
    query_start_loc: np.ndarray  # [R + 1]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [position_rows, T]
    attn_metadata: AttentionMetadata
    sample_mask: np.ndarray  # [R] bool: the request computes its last known token this step
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to turn into logits


class PersistentBuffer:
    """One step input kept across steps: a flat host tensor (pinned when the device is CUDA),
    its numpy view, and its device twin (the host tensor itself on CPU).

    `host(shape)` is where a step writes: the first prod(shape) entries as a contiguous numpy
    array of that shape; `device(shape)` is the same entries on the device. The views of the
    last shape asked for are kept (decode steps ask for the same shapes step after step). A
    step that needs more than the capacity reallocates (doubling), so the sizes given are a
    hint, not a limit. The host side is rewritten only after the previous step's copies are
    done: the runner reads the sampled tokens back at the end of every step, which waits for
    the device.
    """

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.target = device
        self._allocate(max(capacity, 1))

    def _allocate(self, capacity: int) -> None:
        on_cpu = self.target.type == "cpu"
        self.host_tensor = torch.zeros(capacity, dtype=self.dtype, pin_memory=self.target.type == "cuda")
        self.host_array = self.host_tensor.numpy()  # [capacity], shares memory with host_tensor
        self.device_tensor = (
            self.host_tensor if on_cpu else torch.zeros(capacity, dtype=self.dtype, device=self.target)
        )
        self._host_views: tuple[tuple[int, ...], np.ndarray] | None = None
        self._device_views: tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None = None

    def host(self, *shape: int) -> np.ndarray:
        if self._host_views is None or self._host_views[0] != shape:
            size = math.prod(shape)
            if size > len(self.host_array):
                self._allocate(max(size, 2 * len(self.host_array)))
            self._host_views = (shape, self.host_array[:size].reshape(shape))
        return self._host_views[1]

    def device(self, *shape: int) -> torch.Tensor:
        if self._device_views is None or self._device_views[0] != shape:
            size = math.prod(shape)
            source = self.host_tensor[:size].view(shape)
            self._device_views = (shape, source, self.device_tensor[:size].view(shape))
        _, source, target = self._device_views
        if target is not source:
            target.copy_(source, non_blocking=True)
        return target


class StepInputBuilder:
    """Builds each step's `StepInputs` from the persistent batch into persistent buffers sized
    for `max_num_tokens` tokens and the batch's request and block limits."""

    def __init__(
        self,
        batch: InputBatch,
        block_size: int,
        max_num_tokens: int,
        device: torch.device,
        position_rows: int,
    ) -> None:
        self.batch = batch
        self.block_size = block_size
        self.position_rows = position_rows  # 1 (a token's index), 3 (M-RoPE), ...
        max_reqs, max_blocks = batch.block_table.shape
        self.input_ids = PersistentBuffer(max_num_tokens, torch.int64, device)  # [T]
        self.positions = PersistentBuffer(position_rows * max_num_tokens, torch.int64, device)  # [P, T]
        self.slot_mapping = PersistentBuffer(max_num_tokens, torch.int64, device)  # [T]
        self.query_start_loc = PersistentBuffer(max_reqs + 1, torch.int32, device)  # [R + 1]
        self.seq_lens = PersistentBuffer(max_reqs, torch.int32, device)  # [R]
        self.block_table = PersistentBuffer(max_reqs * max_blocks, torch.int32, device)  # [R, B]
        self.logits_indices = PersistentBuffer(max_reqs, torch.int64, device)  # [num_sampled]

    def prepare(self, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        batch = self.batch
        req_ids = sorted(num_scheduled_tokens, key=batch.row_of.__getitem__)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_scheduled = np.fromiter(
            (num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        num_computed = batch.num_computed_tokens[rows]

        token_row = np.repeat(rows, num_scheduled)  # [T]
        # token_index[t] = num_computed[r] + (t - query_start_loc[r]) for the request r of token t
        token_index = np.repeat(num_computed - query_start_loc[:-1], num_scheduled)
        token_index += np.arange(num_tokens)
        np.take(
            batch.token_ids.reshape(-1),
            token_row * batch.token_ids.shape[1] + token_index,
            out=self.input_ids.host(num_tokens),
        )
        slots = self.slot_mapping.host(num_tokens)
        block_ids = batch.block_table[token_row, token_index // self.block_size]
        np.multiply(block_ids, self.block_size, out=slots, dtype=np.int64)
        slots += token_index % self.block_size
        self._write_positions(req_ids, rows, num_scheduled, query_start_loc, token_row, token_index)

        seq_lens = num_computed + num_scheduled
        sample_mask = seq_lens >= batch.num_tokens[rows]
        self.query_start_loc.host(len(rows) + 1)[:] = query_start_loc
        self.seq_lens.host(len(rows))[:] = seq_lens
        max_blocks = int(batch.num_blocks[rows].max()) if len(rows) else 0
        np.take(
            batch.block_table[:, :max_blocks], rows, axis=0, out=self.block_table.host(len(rows), max_blocks)
        )
        logits_indices = query_start_loc[1:][sample_mask] - 1
        self.logits_indices.host(len(logits_indices))[:] = logits_indices
        metadata = AttentionMetadata(
            num_tokens=num_tokens,
            query_start_loc=self.query_start_loc.device(len(rows) + 1),
            seq_lens=self.seq_lens.device(len(rows)),
            block_table=self.block_table.device(len(rows), max_blocks),
            slot_mapping=self.slot_mapping.device(num_tokens),
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
            input_ids=self.input_ids.device(num_tokens),
            positions=self.positions.device(self.position_rows, num_tokens),
            attn_metadata=metadata,
            sample_mask=sample_mask,
            logits_indices=self.logits_indices.device(len(logits_indices)),
        )

    def _write_positions(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
        token_row: np.ndarray,
        token_index: np.ndarray,
    ) -> None:
        """Positions [P, T]: index + delta on every row past a request's position table, the
        table where the span still overlaps it."""
        batch = self.batch
        positions = self.positions.host(self.position_rows, len(token_index))
        np.add(token_index, batch.position_delta[token_row], out=positions[0])
        positions[1:] = positions[0]
        for i in np.nonzero(batch.num_computed_tokens[rows] < batch.mm_end[rows])[0]:
            table = batch.states[req_ids[i]].positions
            if table is None:
                continue
            start = int(batch.num_computed_tokens[rows[i]])
            end = min(start + int(num_scheduled[i]), table.shape[1])
            q0 = int(query_start_loc[i])
            positions[:, q0 : q0 + end - start] = table[:, start:end]


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
