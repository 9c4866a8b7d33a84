"""One worker per device: picks the device, sizes the KV cache, and hosts the model runner."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from mmserve import envs
from mmserve.config import CacheConfig, ExecutionConfig, ModelConfig, SchedulerConfig
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.worker.model_runner import ModelRunner

logger = logging.getLogger("mmserve.worker")


def default_cpu_threads() -> int:
    """Every core this process may run on, as vLLM's CPU backend uses all of a node's cores: the
    model's matmuls and attention are where a step's time goes, while the API server and the
    preprocess workers mostly wait (measured in BENCHMARKS.md, "threads"). MMSERVE_NUM_THREADS
    or `num_threads` set it otherwise, e.g. on a machine shared with other jobs."""
    return max(1, len(os.sched_getaffinity(0)))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device | None = None,
        seed: int = 0,
        execution_config: ExecutionConfig | None = None,
    ) -> None:
        execution_config = execution_config or ExecutionConfig()
        self.device = device or default_device()
        if self.device.type == "cpu":
            torch.set_num_threads(execution_config.num_threads or envs.num_threads() or default_cpu_threads())
        torch.manual_seed(seed)
        self.cache_config = cache_config
        self.max_blocks_useful = scheduler_config.max_num_seqs * -(
            -model_config.max_model_len // cache_config.block_size
        )
        start = time.perf_counter()
        self.runner = ModelRunner(model_config, cache_config, scheduler_config, self.device, execution_config)
        logger.info("loaded the weights in %.1f s", time.perf_counter() - start)
        start = time.perf_counter()
        self.num_blocks = self._num_blocks()
        self.runner.initialize_kv_cache(self.num_blocks)
        kv_bytes = self.num_blocks * self.runner.kv_cache_bytes_per_block()
        logger.info(
            "allocated the KV cache: %d blocks, %.2f GiB, in %.1f s",
            self.num_blocks,
            kv_bytes / (1 << 30),
            time.perf_counter() - start,
        )

    def _num_blocks(self) -> int:
        """Blocks that fit the configured KV memory, the explicit block count, or (auto) the
        free memory (see CacheConfig)."""
        if self.cache_config.num_blocks is not None:
            return self.cache_config.num_blocks
        per_block = self.runner.kv_cache_bytes_per_block()
        memory = self.cache_config.kv_cache_memory_bytes
        if memory is None:
            memory = kv_cache_budget_bytes(self.device, self.cache_config.memory_utilization)
            num = min(memory // per_block, self.max_blocks_useful)
        else:
            num = memory // per_block
        if num < 1:
            raise ValueError(f"a KV cache of {memory} bytes holds no block ({per_block} bytes each)")
        return int(num)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


def kv_cache_budget_bytes(device: torch.device, utilization: float) -> int:
    """Bytes the KV cache may take when sized automatically, measured after the model loaded:
    on CUDA what keeps (1 - utilization) of the device free (activations come out of that
    share); on CPU `utilization` of the memory the system reports available."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(0, int(free - total * (1 - utilization)))
    return int(available_memory_bytes() * utilization)


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable from /proc/meminfo (Linux): what can be allocated without swapping."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} reports no MemAvailable; give --kv-cache-memory explicitly")
