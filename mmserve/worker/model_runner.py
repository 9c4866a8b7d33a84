"""The model runner: applies the scheduler's diffs to the persistent batch, runs the encoder for
images due this step, runs the language model over the packed step, and samples.

One step, in order: update states → encode scheduled images → build inputs (numpy) → embed and
splice image embeddings → forward → logits for requests that finished their known tokens →
sample → append sampled tokens to the batch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from mmserve.config import CacheConfig, ExecutionConfig, ModelConfig, SchedulerConfig
from mmserve.core.sched_output import (
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from mmserve.distributed.parallel_state import get_tp_group
from mmserve.distributed.partition import kv_heads_per_rank
from mmserve.layers.sampler import LogprobsTensors, Sampler, SamplingMetadata
from mmserve.models.registry import family_named
from mmserve.ops.huge_pages import zeros_on_huge_pages
from mmserve.worker.cuda_graphs import DecodeGraphs, capture_decode_graphs, graph_sizes, is_decode_only
from mmserve.worker.encoder_cache import EncoderCache
from mmserve.worker.host_transfer import to_device
from mmserve.worker.input_batch import InputBatch, new_request_state
from mmserve.worker.kernel_plan import load_planned_model
from mmserve.worker.prompt_logprobs import compute_prompt_logprobs
from mmserve.worker.sampling_metadata import SamplingMetadataBuilder
from mmserve.worker.step_inputs import StepInputBuilder, StepInputs, multimodal_scatter_plan
from mmserve.worker.token_constraints import grammar_fields


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        execution_config: ExecutionConfig | None = None,
        encoder_data_parallel: bool = False,
    ) -> None:
        """Builds this rank's shard of the model (the process's tensor-parallel group, joined
        before); `encoder_data_parallel`: the whole vision tower on every rank."""
        execution_config = execution_config or ExecutionConfig()
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = device
        # this rank's KV heads: its share, or the one KV head it replicates
        self.num_kv_heads = kv_heads_per_rank(model_config.num_kv_heads, get_tp_group().world_size)
        self.model, self.kernel_plan, self.attention_backend = load_planned_model(
            model_config,
            device,
            execution_config,
            self.block_size,
            encoder_data_parallel,
            get_tp_group().world_size,
        )
        self.graph_sizes = graph_sizes(
            execution_config, scheduler_config.max_num_seqs, self.attention_backend, device
        )
        self.decode_graphs: DecodeGraphs | None = None  # captured once the KV cache exists
        self.sampler = Sampler()
        self.encoder_cache = EncoderCache()
        self.max_blocks_per_req = -(-model_config.max_model_len // self.block_size)
        self.batch = InputBatch(
            scheduler_config.max_num_seqs, model_config.max_model_len, self.max_blocks_per_req
        )
        self.positions = family_named(model_config.family).prompt_positions(model_config)
        self.step_inputs = StepInputBuilder(
            self.batch, self.block_size, scheduler_config.max_num_batched_tokens, device, self.positions.rows
        )
        self.sampling_metadata = SamplingMetadataBuilder(self.batch, model_config.vocab_size, device)
        self.kv_caches: list[torch.Tensor] = []
        self.num_encoder_calls = 0  # forward passes of the vision tower (tests count these)
        self.prompt_logprob_req_ids: set[str] = set()  # held requests that ask for prompt logprobs

    # ---------------------------------------------------------------- KV cache

    def kv_cache_bytes_per_block(self) -> int:
        c = self.model_config
        element = getattr(torch, c.dtype).itemsize
        return 2 * c.num_layers * self.block_size * self.num_kv_heads * c.head_dim * element

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Per layer one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor (keys, values),
        this rank's KV heads only."""
        c = self.model_config
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        dtype = getattr(torch, c.dtype)
        if self.device.type == "cpu":  # streamed from memory every decode step: huge pages
            self.kv_caches = [zeros_on_huge_pages(shape, dtype) for _ in range(c.num_layers)]
        else:
            self.kv_caches = [
                torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)
            ]
        if self.graph_sizes:
            self.decode_graphs = capture_decode_graphs(
                self.model, self.kv_caches, self.graph_sizes, c, self.max_blocks_per_req, self.device
            )

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        num_encoded = self._run_encoder(scheduler_output)
        inputs = self._prepare_inputs(scheduler_output)
        embeds = self._embed(inputs)
        hidden = self._forward(embeds, inputs)
        prompt_logprobs = {}
        if self.prompt_logprob_req_ids:
            prompt_logprobs = compute_prompt_logprobs(
                self.model.compute_logits, self.batch, inputs, hidden, self.prompt_logprob_req_ids
            )
        output = self._sample(inputs, hidden, scheduler_output)
        self._advance_batch(inputs, output)
        output.num_encoder_runs = num_encoded
        output.prompt_logprobs = prompt_logprobs
        return output

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.dropped_req_ids:
            if req_id in self.batch.row_of:
                self.batch.remove(req_id)
            self.prompt_logprob_req_ids.discard(req_id)
        self.encoder_cache.free(scheduler_output.free_encoder_mm_hashes)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            self.batch.append_blocks(req_id, new_blocks)
            self.batch.num_computed_tokens[self.batch.row_of[req_id]] = num_computed
        for new in scheduler_output.scheduled_new_reqs:
            self._add_request(new)

    def _add_request(self, new: NewRequestData) -> None:
        state = new_request_state(
            new.req_id,
            new.prompt_token_ids,
            new.output_token_ids,
            new.mm_features,
            new.sampling_params,
            self.positions,
        )
        self.batch.add(state, new.num_computed_tokens, new.block_ids)
        if new.sampling_params.prompt_logprobs is not None:
            self.prompt_logprob_req_ids.add(new.req_id)

    def _run_encoder(self, scheduler_output: SchedulerOutput) -> int:
        """Encode, in one vision-tower call, every image scheduled for encoding this step (the
        scheduler lists each image once, and only images this cache does not hold), from the
        pixels the step carries."""
        features = [
            self.batch.states[req_id].mm_features[index]
            for req_id, indices in scheduler_output.scheduled_encoder_inputs.items()
            for index in indices
        ]
        if not features:
            return 0
        step_pixels = scheduler_output.encoder_pixels
        missing = [f.mm_hash for f in features if f.mm_hash not in step_pixels]
        if missing:
            raise RuntimeError(f"images {missing} are scheduled for encoding without their pixels")
        # Each item's pixels as they are (torch wants writable memory): the model concatenates
        # them where it needs one tensor, and a single image (the usual step) is not copied.
        pixels = [
            to_device(np.require(step_pixels[f.mm_hash], requirements="W"), self.device) for f in features
        ]
        embeddings = self.model.encode_images(pixels, [f.grid_thw for f in features])
        self.num_encoder_calls += 1
        for feature, emb in zip(features, embeddings, strict=True):
            self.encoder_cache.put(feature.mm_hash, emb)
        return len(features)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        return self.step_inputs.prepare(scheduler_output.num_scheduled_tokens)

    def _embed(self, inputs: StepInputs) -> torch.Tensor:
        """Token embeddings with each image's placeholder rows replaced by its embeddings."""
        embeds = self.model.embed_input_ids(inputs.input_ids)  # [T, hidden]
        plan = multimodal_scatter_plan(self.batch, inputs)
        if plan:
            sources = [self.encoder_cache.get(h)[first : first + count] for h, first, count, _ in plan]
            destinations = np.concatenate([np.arange(dst, dst + count) for _, _, count, dst in plan])
            rows = to_device(destinations, self.device)
            embeds = self.model.merge_multimodal_embeddings(embeds, rows, torch.cat(sources))
        return embeds

    def _forward(self, embeds: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The language model over the step: a CUDA graph's replay for a decode-only step that
        fits a captured size, else eagerly (or compiled)."""
        metadata = inputs.attn_metadata
        if self.decode_graphs is not None and is_decode_only(
            metadata, inputs.token_index, self.batch.mm_end[inputs.rows]
        ):
            hidden = self.decode_graphs.run(embeds, inputs.positions, metadata)
            if hidden is not None:
                return hidden
        return self.model(embeds, inputs.positions, self.kv_caches, metadata)

    def _sample(
        self, inputs: StepInputs, hidden: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        """One token for each request that computed its last known token this step (within its
        grammar's mask, if any); the others (mid-prefill) get an empty list."""
        positions = np.nonzero(inputs.sample_mask)[0]  # [num_sampled] in the step's order
        sampled_token_ids: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if len(positions):
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            metadata = self._sampling_metadata(inputs, positions, scheduler_output)
            result = self.sampler(logits, metadata)
            for i, (pos, token) in enumerate(zip(positions, result.sampled_token_ids.tolist())):
                req_id = inputs.req_ids[pos]
                sampled_token_ids[pos] = [token]
                num_logprobs = self.batch.states[req_id].sampling_params.logprobs
                if result.logprobs_tensors is not None and num_logprobs is not None:
                    logprobs[req_id] = _logprobs_row(result.logprobs_tensors, i, num_logprobs)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=sampled_token_ids, logprobs=logprobs
        )

    def _sampling_metadata(
        self, inputs: StepInputs, positions: np.ndarray, scheduler_output: SchedulerOutput
    ) -> SamplingMetadata:
        """Sampling inputs of the step's sampled requests (`positions` in the step's order)."""
        metadata = self.sampling_metadata.build(inputs.rows[positions])
        if scheduler_output.grammar_bitmask is None:
            return metadata
        sampled_ids = [inputs.req_ids[pos] for pos in positions]
        grammar = grammar_fields(scheduler_output.grammar_bitmask, sampled_ids, self.device)
        return replace(metadata, **grammar) if grammar else metadata

    def _advance_batch(self, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        """The step is done: its tokens are computed and the sampled ones join their requests."""
        self.batch.num_computed_tokens[inputs.rows] += inputs.num_scheduled
        for row, tokens in zip(inputs.rows, output.sampled_token_ids):
            for token in tokens:
                self.batch.append_token(int(row), token)


def _logprobs_row(tensors: LogprobsTensors, i: int, k: int) -> LogprobsLists:
    return LogprobsLists(
        token_ids=[tensors.logprob_token_ids[i, : k + 1].tolist()],
        logprobs=[tensors.logprobs[i, : k + 1].tolist()],
        sampled_ranks=[int(tensors.sampled_token_ranks[i])],
    )
