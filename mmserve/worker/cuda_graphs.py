"""CUDA graphs for decode-only steps: the model's forward captured once per batch size of a
ladder, replayed with the step's inputs copied into the graphs' static buffers.

A decode-only step (every request computes one token, none of them an image's) of n requests
is padded up to the smallest captured size ≥ n: padding rows get slot -1 (their keys and values
are not stored), a context of one token and a query of their own, so they compute finite junk
that nobody reads. Steps with prompt chunks, image tokens, or more requests than the largest
size run eagerly. The graphs share one memory pool, captured largest first (vLLM's order).
Only backends with `supports_cuda_graphs` are captured: they read the metadata's device tensors
and host ints, never its numpy copies, so what a replay reads is what the buffers hold.

Capturing needs a CUDA device; everything else here (the ladder, the padding, which steps
qualify, the padded inputs a replay reads) is plain tensor code tested on the CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mmserve.config import ExecutionConfig, ModelConfig
from mmserve.layers.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger("mmserve.worker")

MAX_DEFAULT_CAPTURE_SIZE = 512
WARMUP_RUNS = 2  # before capturing a size: Triton compiles and torch.compile traces happen here

# forward(inputs_embeds [T, hidden], positions [3, T], kv_caches, metadata) → hidden [T, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, configured: Sequence[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending: `configured` (those ≤ max_num_seqs), or 1, 2, 4
    and every multiple of 8 up to min(max_num_seqs, 512), plus that limit itself, so that any
    decode step up to the limit finds a size (vLLM's default ladder)."""
    if configured is not None:
        return sorted({size for size in configured if size <= max_num_seqs})
    limit = min(max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE)
    ladder = {size for size in (1, 2, 4, *range(8, limit + 1, 8)) if size <= limit}
    return sorted(ladder | {limit})


def graph_sizes(
    execution: ExecutionConfig, max_num_seqs: int, backend: AttentionBackend, device: torch.device
) -> list[int]:
    """The sizes to capture for this runner; empty (no graphs) off CUDA, with --enforce-eager,
    or with a backend that cannot be captured (the torch reference reads host copies)."""
    if device.type != "cuda" or execution.enforce_eager:
        return []
    if not backend.supports_cuda_graphs:
        logger.info("no CUDA graphs: the %s attention backend cannot be captured", backend.name)
        return []
    return capture_sizes(max_num_seqs, execution.compilation.cudagraph_capture_sizes)


def padded_size(num_requests: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size ≥ num_requests (sizes ascending), or None: run eagerly."""
    index = bisect.bisect_left(sizes, num_requests)
    return sizes[index] if index < len(sizes) else None


def is_decode_only(metadata: AttentionMetadata, token_index: np.ndarray, mm_end: np.ndarray) -> bool:
    """One token per request and none of them an image placeholder (token_index [R] is each
    token's place in its sequence, mm_end [R] where its request's images end): the step reads
    only what the static buffers hold. Image tokens need their embeddings spliced in, and some
    families add item features between layers (DeepStack): a captured graph does neither."""
    return metadata.max_query_len == 1 and bool((token_index >= mm_end).all())


class StaticDecodeInputs:
    """The device buffers every captured graph reads, sized for the largest capture size.

    Row r of a padded step is request r, which owns query row r: `query_start_loc` is
    arange(size + 1) for real rows and padding alike, so it is written once, here. Block-table
    columns past a request's context keep stale ids from earlier steps; the kernels never read
    them (a request reads ⌈seq_len / block_size⌉ entries), and stale ids are valid block ids.
    """

    def __init__(
        self,
        max_size: int,
        hidden_size: int,
        max_blocks_per_request: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        position_rows: int,
    ) -> None:
        self.max_model_len = max_model_len
        self.embeds = torch.zeros(max_size, hidden_size, dtype=dtype, device=device)  # [N, hidden]
        self.positions = torch.zeros(position_rows, max_size, dtype=torch.int64, device=device)  # [P, N]
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)  # [N + 1]
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)  # [N]
        self.block_table = torch.zeros(max_size, max_blocks_per_request, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)  # [N]

    def metadata(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows is captured with. max_seq_len is the model length:
        an upper bound fixes the kernels' launch shape (split counts) for every later replay."""
        return AttentionMetadata(
            num_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=np.arange(size + 1, dtype=np.int64),  # never read by graph backends
            seq_lens_cpu=np.ones(size, dtype=np.int64),
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def fill(
        self, embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, size: int
    ) -> None:
        """Copy a decode step of n ≤ size requests into rows [0, n) and reset the padding rows
        [n, size) to harmless values: slot -1 (nothing stored) and a one-token context."""
        n = embeds.shape[0]
        self.embeds[:n].copy_(embeds)
        self.positions[:, :n].copy_(positions)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.block_table[:n, : metadata.block_table.shape[1]].copy_(metadata.block_table)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)


class DecodeGraphs:
    """One captured forward per size; `run` replays the one a decode step pads up to."""

    def __init__(
        self, forward: Forward, kv_caches: list[torch.Tensor], static: StaticDecodeInputs, sizes: list[int]
    ):
        self.forward = forward
        self.kv_caches = kv_caches
        self.static = static
        self.sizes = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [size, hidden] each, inside the shared pool
        self.num_replays = 0  # decode steps served by a graph (checks and tests count these)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool; logs progress. In
        inference mode, as the steps that replay them run."""
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        logger.info(
            "capturing CUDA graphs for %d decode batch sizes (%d to %d)",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
        )
        pool = None
        for done, size in enumerate(reversed(self.sizes), 1):
            metadata = self.static.metadata(size)
            embeds, positions = self.static.embeds[:size], self.static.positions[:, :size]
            for _ in range(WARMUP_RUNS):
                self.forward(embeds, positions, self.kv_caches, metadata)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(embeds, positions, self.kv_caches, metadata)
            pool = graph.pool()
            self.graphs[size] = graph
            logger.debug("captured decode graph %d/%d (batch %d)", done, len(self.sizes), size)
        torch.cuda.synchronize()
        used = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        logger.info(
            "captured %d CUDA graphs in %.1f s, %.0f MiB", len(self.sizes), time.perf_counter() - start, used
        )

    def run(
        self, embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """hidden [n, hidden] of a decode step by replay, or None when no size fits. The result
        is a view of the graph's output buffer, valid until the next replay."""
        n = embeds.shape[0]
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        self.static.fill(embeds, positions, metadata, size)
        self.num_replays += 1
        return self.replay(size)[:n]

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` over the static buffers; its output buffer [size, hidden]."""
        self.graphs[size].replay()
        return self.outputs[size]


def capture_decode_graphs(
    forward: Forward,
    kv_caches: list[torch.Tensor],
    sizes: list[int],
    config: ModelConfig,
    max_blocks_per_request: int,
    device: torch.device,
) -> DecodeGraphs:
    """Static buffers for the largest size, then every size captured (start-up, after the KV
    cache exists: the graphs hold its addresses)."""
    static = StaticDecodeInputs(
        sizes[-1],
        config.hidden_size,
        max_blocks_per_request,
        config.max_model_len,
        getattr(torch, config.dtype),
        device,
        config.position_rows,
    )
    graphs = DecodeGraphs(forward, kv_caches, static, sizes)
    graphs.capture()
    return graphs
