"""The choice of executor for an engine configuration."""

from __future__ import annotations

import torch

from mmserve.config import EngineConfig
from mmserve.executor.abstract import Executor
from mmserve.executor.worker_factory import on_cuda


def create_executor(config: EngineConfig) -> Executor:
    """The executor `config.parallel` asks for (refusing combinations that cannot run)."""
    parallel = config.parallel
    backend = parallel.executor_backend
    if on_cuda(config) and backend == "mp" and parallel.world_size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {parallel.world_size} needs as many GPUs; "
            f"this machine has {torch.cuda.device_count()} (use the ray backend to span machines)"
        )
    if backend == "uni":
        from mmserve.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    if backend == "mp":
        from mmserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from mmserve.executor.ray_executor import RayExecutor

    return RayExecutor(config)
