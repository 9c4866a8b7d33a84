"""One worker per device: picks the device, sizes the KV cache, and hosts the model runner."""

from __future__ import annotations

import os

import torch

from mmserve import envs
from mmserve.config import CacheConfig, ModelConfig, SchedulerConfig
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.worker.model_runner import ModelRunner


def default_cpu_threads() -> int:
    """All cores but one: the API server and the image preprocessing processes need CPU too, and
    an oversubscribed torch thread pool is several times slower than a smaller one (measured in
    benchmarks/results/visionarena.md: 6-8x on 2 cores)."""
    return max(1, (os.cpu_count() or 1) - 1)


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
    ) -> None:
        self.device = device or default_device()
        if self.device.type == "cpu":
            torch.set_num_threads(envs.num_threads() or default_cpu_threads())
        torch.manual_seed(seed)
        self.cache_config = cache_config
        self.runner = ModelRunner(model_config, cache_config, scheduler_config, self.device)
        self.num_blocks = self._num_blocks()
        self.runner.initialize_kv_cache(self.num_blocks)

    def _num_blocks(self) -> int:
        """Blocks that fit the configured KV memory (or the explicit block count)."""
        if self.cache_config.num_blocks is not None:
            return self.cache_config.num_blocks
        num = self.cache_config.kv_cache_memory_bytes // self.runner.kv_cache_bytes_per_block()
        if num < 1:
            raise ValueError(
                f"kv_cache_memory of {self.cache_config.kv_cache_memory_bytes} bytes holds no block "
                f"({self.runner.kv_cache_bytes_per_block()} bytes each)"
            )
        return int(num)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
