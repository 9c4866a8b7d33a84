"""The persistent batch: every request the runner holds, one row each, in fixed numpy arrays.

Rows live across steps; a step only writes what changed (new rows, appended blocks, sampled
tokens) instead of rebuilding inputs. Rows are kept dense (0..num_reqs-1): removing a request
moves the last row into its hole, so per-step work is slicing, not searching. `version` changes
whenever a row changes hands (a request added or removed), so what is derived from the rows'
requests (sampling metadata) can be kept while it stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmserve.models.family import PromptPositions
from mmserve.protocol import MultiModalFeature
from mmserve.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner keeps per request beyond its row of the arrays."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    positions: np.ndarray | None  # [rows, num_prompt_tokens] int64; None: the token index
    position_delta: int  # position of a token past the table is its index + delta
    mm_end: int  # end of the last item's placeholders (the position table reaches it)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.position_delta = np.zeros(max_num_reqs, dtype=np.int64)
        self.mm_end = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str] = []  # row → request id (dense)
        self.row_of: dict[str, int] = {}
        self.states: dict[str, RequestState] = {}
        self.version = 0  # bumped by add and remove

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, state: RequestState, num_computed_tokens: int, block_ids: list[int]) -> int:
        if self.num_reqs == self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} requests)")
        row = self.num_reqs
        n_prompt, n = len(state.prompt_token_ids), state.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"request {state.req_id} has {n} tokens > max_model_len {self.max_model_len}")
        self.token_ids[row, :n_prompt] = state.prompt_token_ids
        self.token_ids[row, n_prompt:n] = state.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.position_delta[row] = state.position_delta
        self.mm_end[row] = state.mm_end
        self.req_ids.append(state.req_id)
        self.row_of[state.req_id] = row
        self.version += 1
        self.states[state.req_id] = state
        self.append_blocks(state.req_id, block_ids)
        return row

    def remove(self, req_id: str) -> None:
        """Drop a request; the last row moves into its place (rows stay dense)."""
        row = self.row_of.pop(req_id)
        del self.states[req_id]
        self.version += 1
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            for array in (
                self.num_tokens,
                self.num_prompt_tokens,
                self.num_computed_tokens,
                self.num_blocks,
                self.position_delta,
                self.mm_end,
            ):
                array[row] = array[last]
            n = self.num_tokens[row]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.block_table[row, : self.num_blocks[row]] = self.block_table[last, : self.num_blocks[row]]
            self.req_ids[row] = moved
            self.row_of[moved] = row
        self.req_ids.pop()

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.row_of[req_id]
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.states[self.req_ids[row]].output_token_ids.append(token_id)


def new_request_state(
    req_id: str,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    mm_features: list[MultiModalFeature],
    sampling_params: SamplingParams,
    positions: PromptPositions,
) -> RequestState:
    """State for a request entering the batch; its prompt's positions are computed once, by the
    model family's `positions`."""
    table, delta = positions.of_prompt(len(prompt_token_ids), mm_features)
    return RequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt_token_ids),
        output_token_ids=list(output_token_ids),
        mm_features=mm_features,
        sampling_params=sampling_params,
        positions=table,
        position_delta=delta,
        mm_end=max((f.offset + f.length for f in mm_features), default=0),
    )
