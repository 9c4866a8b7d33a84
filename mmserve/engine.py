"""Wires an EngineCore to its executor (the workers) and its grammar manager (structured
outputs). The only module that imports both `core` and the executors.

Used in-process by the offline `LLM`, and by the EngineCore process (engine_process.py) when serving.
"""

from __future__ import annotations

from mmserve.config import EngineConfig
from mmserve.core.engine_core import EngineCore
from mmserve.core.scheduler import Scheduler
from mmserve.executor.factory import create_executor
from mmserve.structured_output.manager import StructuredOutputManager


def build_engine_core(config: EngineConfig) -> EngineCore:
    executor = create_executor(config)
    try:
        scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks=executor.num_blocks,
            encoder_budget=config.encoder_budget,
            encoder_cache_size=config.encoder_cache_size,
            grammar=StructuredOutputManager(
                config.model.path, config.model.vocab_size, list(config.model.eos_token_ids)
            ),
        )
    except BaseException:
        executor.shutdown()
        raise
    return EngineCore(scheduler, executor, vocab_size=config.model.vocab_size)
