"""`EngineArgs`: what a user sets for the engine (the `LLM(...)` keyword arguments, the
`mmserve serve` flags), and how it builds the `EngineConfig` slices of `mmserve.config`.

Its defaults are read from those slices' fields (`field_default`), never written twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmserve.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ExecutionConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    check_model_fits,
    field_default,
)
from mmserve.device_probe import cuda_available
from mmserve.model_config import cpu_computes_natively
from mmserve.models.registry import load_model_config

_GIB = 1 << 30


@dataclass(frozen=True)
class EngineArgs:
    """What a user sets for the engine: the keyword arguments of `LLM(...)` and the flags of
    `mmserve serve` (`--max-num-seqs` is `max_num_seqs`), named like vLLM's engine args. The
    defaults are read from the config slices, so `--help` and `LLM(...)` cannot disagree."""

    model: str | Path
    dtype: str = "auto"  # the checkpoint's
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = field_default(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = field_default(SchedulerConfig, "max_num_batched_tokens")
    long_prefill_token_threshold: int = field_default(SchedulerConfig, "long_prefill_token_threshold")
    encoder_compute_budget: int = field_default(SchedulerConfig, "encoder_compute_budget")
    encoder_cache_size: int = field_default(SchedulerConfig, "encoder_cache_size")
    max_waiting_requests: int = field_default(SchedulerConfig, "max_waiting_requests")
    scheduling_policy: str = field_default(SchedulerConfig, "scheduling_policy")
    block_size: int = field_default(CacheConfig, "block_size")
    num_kv_blocks: int | None = field_default(CacheConfig, "num_blocks")
    kv_cache_memory: int | None = field_default(CacheConfig, "kv_cache_memory_bytes")  # bytes; None = auto
    memory_utilization: float = field_default(CacheConfig, "memory_utilization")
    enable_prefix_caching: bool = field_default(CacheConfig, "enable_prefix_caching")
    limit_mm_per_prompt: dict[str, int] = field(
        default_factory=lambda: field_default(MultiModalConfig, "limit_per_prompt")
    )
    mm_processor_cache_gb: float = field_default(MultiModalConfig, "processor_cache_bytes") / _GIB
    media_io_kwargs: dict[str, dict[str, Any]] = field(
        default_factory=lambda: field_default(MultiModalConfig, "media_io_kwargs")
    )
    preprocess_workers: int | None = field_default(MultiModalConfig, "preprocess_workers")
    mm_processor_kwargs: dict[str, Any] = field(
        default_factory=lambda: field_default(MultiModalConfig, "processor_kwargs")
    )
    attention_backend: str = field_default(ExecutionConfig, "attention_backend")
    num_threads: int | None = field_default(ExecutionConfig, "num_threads")
    cpu_threads_bind: str = field_default(ExecutionConfig, "cpu_threads_bind")
    enforce_eager: bool = field_default(ExecutionConfig, "enforce_eager")
    compilation_config: dict[str, Any] | None = None  # CompilationConfig's fields; None = defaults
    tensor_parallel_size: int = field_default(ParallelConfig, "tensor_parallel_size")
    distributed_executor_backend: str | None = field_default(ParallelConfig, "distributed_executor_backend")
    mm_encoder_tp_mode: str = field_default(ParallelConfig, "mm_encoder_tp_mode")
    seed: int = field_default(EngineConfig, "seed")
    device: str | None = field_default(EngineConfig, "device")

    def create_engine_config(self) -> EngineConfig:
        """Read the model folder and build every slice (raises FileNotFoundError / ValueError).

        dtype "auto" is the checkpoint's, except on a CPU that cannot compute it natively, where
        it is float32 (a bf16 checkpoint then runs in float32, as fast and exact)."""
        model = load_model_config(self.model, self.dtype, self.max_model_len, self.mm_processor_kwargs)
        on_cpu = (self.device or ("cuda" if cuda_available() else "cpu")).startswith("cpu")
        if not on_cpu and self.cpu_threads_bind not in ("auto", "none"):
            raise ValueError(
                f"--cpu-threads-bind {self.cpu_threads_bind} pins the threads of a CPU engine; "
                "this engine runs on CUDA (leave it auto)"
            )
        if self.dtype == "auto" and on_cpu and not cpu_computes_natively(model.dtype):
            model = dataclasses.replace(model, dtype="float32")
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            mm_encoder_tp_mode=self.mm_encoder_tp_mode,
        )
        check_model_fits(model, parallel)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory,
                enable_prefix_caching=self.enable_prefix_caching,
                memory_utilization=self.memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=model.max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                encoder_compute_budget=self.encoder_compute_budget,
                encoder_cache_size=self.encoder_cache_size,
                max_waiting_requests=self.max_waiting_requests,
                scheduling_policy=self.scheduling_policy,
            ),
            multimodal=MultiModalConfig(
                limit_per_prompt=dict(self.limit_mm_per_prompt or {}),
                processor_cache_bytes=int(self.mm_processor_cache_gb * _GIB),
                preprocess_workers=self.preprocess_workers,
                media_io_kwargs=dict(self.media_io_kwargs or {}),
                processor_kwargs=dict(self.mm_processor_kwargs or {}),
            ),
            execution=ExecutionConfig(
                attention_backend=self.attention_backend,
                num_threads=self.num_threads,
                cpu_threads_bind=self.cpu_threads_bind,
                enforce_eager=self.enforce_eager,
                compilation=CompilationConfig.from_dict(self.compilation_config),
            ),
            parallel=parallel,
            seed=self.seed,
            device=self.device,
        )
