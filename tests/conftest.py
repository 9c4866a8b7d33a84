"""Suite-wide fixtures: generated checkpoints live in a per-user cache shared by all tests.

Without a GPU, Triton kernels run in Triton's interpreter, which must be chosen before triton is
first imported (torch imports it lazily while the suite is collected).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mmserve.testing.checkpoints import checkpoint

torch.set_num_threads(2)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="session", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model_dir(family):
    return checkpoint(family)
