"""Suite-wide fixtures: generated checkpoints live in a per-user cache shared by all tests."""

from __future__ import annotations

import pytest
import torch

from mmserve.testing.checkpoints import checkpoint

torch.set_num_threads(2)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="session", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_dir(family):
    return checkpoint(family)
