"""A real `mmserve serve` subprocess on the tiny Qwen2-VL checkpoint, shared by a test module."""

from __future__ import annotations

import pytest

from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.server import ServerProcess

SERVER_ARGS = ("--preprocess-workers", "1", "--max-num-batched-tokens", "64", "--kv-cache-memory", "64MiB")


@pytest.fixture(scope="module")
def model_path():
    return checkpoint("qwen2_vl")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(model_path, *SERVER_ARGS, log_path=tmp_path_factory.mktemp("server") / "log")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()
