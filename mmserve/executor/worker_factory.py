"""A worker for one rank, built from the engine's configuration (every executor builds its
workers here, so a rank is the same thing whatever process or node hosts it)."""

from __future__ import annotations

import torch

from mmserve.config import EngineConfig
from mmserve.distributed.parallel_state import DistributedInit
from mmserve.worker.worker import Worker


def on_cuda(config: EngineConfig) -> bool:
    """Whether the workers run on GPUs: the configured device, else CUDA when there is one."""
    return (config.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")


def distributed_backend(config: EngineConfig) -> str:
    return "nccl" if on_cuda(config) else "gloo"


def rank_device(config: EngineConfig, rank: int) -> torch.device | None:
    """The configured device, one GPU per rank on CUDA (None: the worker's default)."""
    if config.device is None:
        return None
    device = torch.device(config.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank)
    return device


def build_worker(config: EngineConfig, distributed_init: DistributedInit | None = None) -> Worker:
    rank = 0 if distributed_init is None else distributed_init.rank
    return Worker(
        config.model,
        config.cache,
        config.scheduler,
        device=rank_device(config, rank),
        seed=config.seed,
        execution_config=config.execution,
        parallel_config=config.parallel,
        distributed_init=distributed_init,
    )
