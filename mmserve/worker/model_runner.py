"""The model runner: applies the scheduler's diffs to the persistent batch, runs the encoder for
images due this step, runs the language model over the packed step, and samples.

One step, in order: update states → encode scheduled images → build inputs (numpy) → embed and
splice image embeddings → forward → logits for requests that finished their known tokens →
sample → append sampled tokens to the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from mmserve.config import CacheConfig, ExecutionConfig, ModelConfig, SchedulerConfig
from mmserve.core.sched_output import (
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from mmserve.layers.attention import get_attention_backend
from mmserve.layers.sampler import LogprobsTensors, Sampler
from mmserve.models.loader import load_model
from mmserve.worker.encoder_cache import EncoderCache
from mmserve.worker.input_batch import InputBatch, new_request_state
from mmserve.worker.prompt_logprobs import compute_prompt_logprobs
from mmserve.worker.sampling_metadata import build_sampling_metadata
from mmserve.worker.step_inputs import StepInputs, multimodal_scatter_plan, prepare_step_inputs
from mmserve.worker.token_constraints import grammar_fields


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        execution_config: ExecutionConfig | None = None,
    ) -> None:
        execution_config = execution_config or ExecutionConfig()
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.device = device
        self.attention_backend = get_attention_backend(execution_config.attention_backend, device)
        self.model = load_model(model_config, self.attention_backend, device)
        self.sampler = Sampler()
        self.encoder_cache = EncoderCache()
        max_blocks_per_req = -(-model_config.max_model_len // self.block_size)
        self.batch = InputBatch(scheduler_config.max_num_seqs, model_config.max_model_len, max_blocks_per_req)
        self.kv_caches: list[torch.Tensor] = []
        self.num_encoder_calls = 0  # forward passes of the vision tower (tests count these)
        self.prompt_logprob_req_ids: set[str] = set()  # held requests that ask for prompt logprobs

    # ---------------------------------------------------------------- KV cache

    def kv_cache_bytes_per_block(self) -> int:
        c = self.model_config
        element = torch.empty((), dtype=c.dtype).element_size()
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * element

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Per layer one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor (keys, values)."""
        c = self.model_config
        shape = (2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=c.dtype, device=self.device) for _ in range(c.num_layers)]

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        num_encoded = self._run_encoder(scheduler_output)
        inputs = prepare_step_inputs(
            self.batch, scheduler_output.num_scheduled_tokens, self.block_size, self.device
        )
        embeds = self._embed(inputs)
        hidden = self.model(embeds, inputs.positions, self.kv_caches, inputs.attn_metadata)
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
            self.model_config.vision.spatial_merge_size,
            self.model_config.vision.tokens_per_second,
        )
        self.batch.add(state, new.num_computed_tokens, new.block_ids)
        if new.sampling_params.prompt_logprobs is not None:
            self.prompt_logprob_req_ids.add(new.req_id)

    def _run_encoder(self, scheduler_output: SchedulerOutput) -> int:
        """Encode, in one vision-tower call, every image scheduled for encoding this step (the
        scheduler lists each image once, and only images this cache does not hold)."""
        features = [
            self.batch.states[req_id].mm_features[index]
            for req_id, indices in scheduler_output.scheduled_encoder_inputs.items()
            for index in indices
        ]
        if not features:
            return 0
        for f in features:
            if f.pixel_values is None:
                raise RuntimeError(f"image {f.mm_hash} is scheduled for encoding but has no pixels")
        pixels = torch.from_numpy(np.concatenate([f.pixel_values for f in features])).to(self.device)
        embeddings = self.model.encode_images(pixels, [f.grid_thw for f in features])
        self.num_encoder_calls += 1
        for feature, emb in zip(features, embeddings, strict=True):
            self.encoder_cache.put(feature.mm_hash, emb)
        return len(features)

    def _embed(self, inputs: StepInputs) -> torch.Tensor:
        """Token embeddings with each image's placeholder rows replaced by its embeddings."""
        embeds = self.model.embed_input_ids(inputs.input_ids)  # [T, hidden]
        plan = multimodal_scatter_plan(self.batch, inputs)
        if plan:
            sources = [self.encoder_cache.get(h)[first : first + count] for h, first, count, _ in plan]
            destinations = np.concatenate([np.arange(dst, dst + count) for _, _, count, dst in plan])
            rows = torch.from_numpy(destinations).to(self.device)
            embeds = self.model.merge_multimodal_embeddings(embeds, rows, torch.cat(sources))
        return embeds

    def _sample(
        self, inputs: StepInputs, hidden: torch.Tensor, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput:
        """One token for each request that computed its last known token this step (within its
        grammar's mask, if any); the others (mid-prefill) get an empty list."""
        sampled_rows = inputs.rows[inputs.sample_mask]
        sampled_token_ids: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if len(sampled_rows):
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            metadata = build_sampling_metadata(
                self.batch, sampled_rows, self.model_config.vocab_size, self.device
            )
            positions = np.nonzero(inputs.sample_mask)[0]
            sampled_ids = [inputs.req_ids[pos] for pos in positions]
            for name, value in grammar_fields(
                scheduler_output.grammar_bitmask, sampled_ids, self.device
            ).items():
                setattr(metadata, name, value)
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
