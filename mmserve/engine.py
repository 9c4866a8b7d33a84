"""Wires an EngineCore to its worker and its grammar manager (structured outputs). The only
module that imports both `core` and `worker`.

Used in-process by the offline `LLM`, and by the EngineCore process (engine_process.py) when serving.
"""

from __future__ import annotations

import torch

from mmserve.config import EngineConfig
from mmserve.core.engine_core import EngineCore
from mmserve.core.scheduler import Scheduler
from mmserve.structured_output.manager import StructuredOutputManager
from mmserve.worker.worker import Worker


def build_engine_core(config: EngineConfig) -> EngineCore:
    device = torch.device(config.device) if config.device else None
    worker = Worker(
        config.model,
        config.cache,
        config.scheduler,
        device=device,
        seed=config.seed,
        execution_config=config.execution,
    )
    scheduler = Scheduler(
        config.scheduler,
        config.cache,
        num_blocks=worker.num_blocks,
        encoder_budget=config.encoder_budget,
        encoder_cache_size=config.encoder_cache_size,
        grammar=StructuredOutputManager(
            config.model.path, config.model.vocab_size, list(config.model.eos_token_ids)
        ),
    )
    return EngineCore(scheduler, worker, vocab_size=config.model.vocab_size)
