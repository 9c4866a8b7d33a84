"""Fixtures for the preprocess tests: both processors for each configuration, and pools that
are closed after each test and checked for leftover shared-memory segments."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from preprocess_cases import Processors
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmserve.testing.checkpoints import checkpoint
from preprocess.pool import PreprocessPool
from preprocess.qwen_vl import QwenVLImageSettings
from preprocess.shm import list_segments

_pool_prefixes: list[str] = []


def _from_checkpoint(family: str) -> Processors:
    folder = checkpoint(family)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    return Processors(
        QwenVLImageSettings.from_hf_config(config), Qwen2VLImageProcessorPil.from_pretrained(folder)
    )


@pytest.fixture(scope="session")
def processors() -> dict[str, Processors]:
    return {
        "tiny": _from_checkpoint("qwen2_vl"),
        "qwen2_5": _from_checkpoint("qwen2_5_vl"),
        "default": Processors(QwenVLImageSettings(), Qwen2VLImageProcessorPil()),
    }


@pytest.fixture
def make_pool(processors: dict[str, Processors]) -> Iterator[Callable[..., PreprocessPool]]:
    """`make_pool(**kwargs)`: a pool on the tiny checkpoint's settings, closed after the test,
    which must then leave no segment behind."""
    pools: list[PreprocessPool] = []

    def make(**kwargs: object) -> PreprocessPool:
        kwargs.setdefault("settings", processors["tiny"].settings)
        pool = PreprocessPool(**kwargs)
        pools.append(pool)
        _pool_prefixes.append(pool.segment_prefix)
        return pool

    yield make
    for pool in pools:
        pool.close()
        assert list_segments(pool.segment_prefix) == []


@pytest.fixture(scope="session", autouse=True)
def no_segment_outlives_the_session() -> Iterator[None]:
    yield
    leftovers = [name for prefix in _pool_prefixes for name in list_segments(prefix)]
    assert leftovers == [], f"shared-memory segments left in /dev/shm: {leftovers}"
