"""Run the Triton kernels on a GPU when there is one, else on CPU tensors in Triton's interpreter
(tests/conftest.py chose it before triton was imported; `mmserve.ops.triton` patches it to
compute like a GPU). The tests skip (per module) only where Triton cannot be imported.
"""

from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
