"""One worker per device (one per tensor-parallel rank): joins its rank's group, picks the
device, sizes the KV cache, and hosts the model runner.

The executor drives it in two steps as vLLM's does: `determine_num_blocks` (what fits this
rank), then `initialize_kv_cache` with the count every rank can hold (the smallest), so the
scheduler's block ids mean the same slots on every rank."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from mmserve import envs
from mmserve.config import CacheConfig, ExecutionConfig, ModelConfig, ParallelConfig, SchedulerConfig
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.distributed.parallel_state import DistributedInit, get_tp_group, init_tensor_parallel
from mmserve.layers.packed_weights import weight_bytes
from mmserve.worker.cpu_memory import keep_freed_memory
from mmserve.worker.cpu_threads import configure_cpu_threads
from mmserve.worker.model_runner import ModelRunner

logger = logging.getLogger("mmserve.worker")


def default_device(rank: int = 0) -> torch.device:
    return torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device | None = None,
        seed: int = 0,
        execution_config: ExecutionConfig | None = None,
        parallel_config: ParallelConfig | None = None,
        distributed_init: DistributedInit | None = None,
    ) -> None:
        """`distributed_init`: this rank's place in a tensor-parallel group (None: one rank)."""
        execution_config = execution_config or ExecutionConfig()
        parallel_config = parallel_config or ParallelConfig()
        if distributed_init is not None:
            init_tensor_parallel(distributed_init)
        self.rank = get_tp_group().rank
        self.world_size = get_tp_group().world_size
        self.device = device or default_device(self.rank)
        if self.device.type == "cpu":
            # the ranks of one machine share its cores
            threads = execution_config.num_threads or envs.num_threads()
            configure_cpu_threads(execution_config.cpu_threads_bind, threads, self.rank, self.world_size)
            keep_freed_memory()  # before the model loads: activations then reuse freed pages
        torch.manual_seed(seed)  # the same on every rank: random sampling draws alike
        self.cache_config = cache_config
        self.max_blocks_useful = scheduler_config.max_num_seqs * -(
            -model_config.max_model_len // cache_config.block_size
        )
        start = time.perf_counter()
        self.runner = ModelRunner(
            model_config,
            cache_config,
            scheduler_config,
            self.device,
            execution_config,
            encoder_data_parallel=parallel_config.mm_encoder_tp_mode == "data",
        )
        logger.info("loaded the weights in %.1f s", time.perf_counter() - start)

    def determine_num_blocks(self) -> int:
        """Blocks that fit the configured KV memory, the explicit block count, or (auto) this
        rank's share of the free memory (see CacheConfig)."""
        if self.cache_config.num_blocks is not None:
            return self.cache_config.num_blocks
        per_block = self.runner.kv_cache_bytes_per_block()
        memory = self.cache_config.kv_cache_memory_bytes
        if memory is None:
            memory = kv_cache_budget_bytes(self.device, self.cache_config.memory_utilization)
            if self.device.type == "cpu":
                memory //= self.world_size  # the ranks of one machine share its memory
            num = min(memory // per_block, self.max_blocks_useful)
        else:
            num = memory // per_block
        if num < 1:
            raise ValueError(f"a KV cache of {memory} bytes holds no block ({per_block} bytes each)")
        return int(num)

    def startup_info(self) -> dict[str, str | int]:
        """What the start-up block reports of this rank: device, torch threads, attention backend."""
        return {
            "device": str(self.device),
            "num_threads": torch.get_num_threads(),
            "attention_backend": self.runner.attention_backend.name,
        }

    def initialize_kv_cache(self, num_blocks: int) -> None:
        start = time.perf_counter()
        self.runner.initialize_kv_cache(num_blocks)
        logger.info(
            "allocated the KV cache: %d blocks, %.2f GiB, in %.1f s",
            num_blocks,
            num_blocks * self.runner.kv_cache_bytes_per_block() / (1 << 30),
            time.perf_counter() - start,
        )

    def shard_info(self) -> dict:
        """What this rank holds and has sent: its KV heads and cache bytes, its parameter bytes,
        and its collectives' cumulative calls and bytes per operation (the benchmarks and tests
        read these through `collective_rpc`)."""
        group = get_tp_group()
        return {
            "rank": self.rank,
            "num_kv_heads": self.runner.num_kv_heads,
            "kv_cache_bytes": sum(t.numel() * t.element_size() for t in self.runner.kv_caches),
            "parameter_bytes": weight_bytes(self.runner.model),
            "collective_calls": dict(group.stats.calls),
            "collective_bytes": dict(group.stats.bytes),
        }

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


CPU_KV_CACHE_CAP_BYTES = 4 << 30
"""The most an automatically sized CPU KV cache takes, vLLM-CPU's default (VLLM_CPU_KVCACHE_SPACE
unset = 4 GiB): host memory is shared with the API server, the preprocess pool and whatever else
runs on the machine, and the cache is zero-filled, so every byte of it is resident."""


def kv_cache_budget_bytes(device: torch.device, utilization: float) -> int:
    """Bytes the KV cache may take when sized automatically, measured after the model loaded:
    on CUDA what keeps (1 - utilization) of the device free (activations come out of that
    share); on CPU `utilization` of the memory the system reports available, at most
    CPU_KV_CACHE_CAP_BYTES (`--kv-cache-memory` sets more)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - total * (1 - utilization)))
    return min(CPU_KV_CACHE_CAP_BYTES, int(available_memory_bytes() * utilization))


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable from /proc/meminfo (Linux): what can be allocated without swapping."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} reports no MemAvailable; give --kv-cache-memory explicitly")
