"""The language model's forward never waits for the device: no op that reads a tensor's value
back to the host (`.item()`, `int(t)`, `bool(t)`, a data-dependent shape) runs inside it, on
any kernel set, over a step of prompt chunks (one through an image) and a step of decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmserve.config import CacheConfig, ExecutionConfig, SchedulerConfig
from mmserve.models.registry import load_model_config
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.driver import ChunkedDriver
from mmserve.testing.reference import PromptInputs
from mmserve.worker.model_runner import ModelRunner

# Ops whose result on an accelerator needs the host to wait: a scalar read back, or an output
# shape that depends on the values.
SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item")


class RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def prompt_with_image(rng: np.random.Generator, image_token_id: int) -> PromptInputs:
    text = rng.integers(0, 1000, 20).tolist()
    pixels = rng.standard_normal((16, 3 * 2 * 14 * 14)).astype(np.float32)  # grid (1, 4, 4)
    return PromptInputs(text[:6] + [image_token_id] * 4 + text[6:], [pixels], [(1, 4, 4)], [(6, 4)])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_forward_reads_nothing_back_from_the_device(backend):
    config = load_model_config(checkpoint("qwen2_vl"), dtype="float32")
    runner = ModelRunner(
        config,
        CacheConfig(block_size=16),
        SchedulerConfig(max_num_seqs=4),
        torch.device("cpu"),
        ExecutionConfig(attention_backend=backend),
    )
    runner.initialize_kv_cache(num_blocks=64)
    recorder = RecordOps()
    forward = runner.model.forward

    def recorded_forward(*args, **kwargs):
        with recorder:
            return forward(*args, **kwargs)

    runner.model.forward = recorded_forward
    rng = np.random.default_rng(0)
    prompts = [
        prompt_with_image(rng, config.image_token_id),
        PromptInputs(rng.integers(0, 1000, 9).tolist(), [], [], []),
    ]
    ChunkedDriver(runner).generate(prompts, max_new_tokens=3, chunk_size=8)
    # the recorder saw the forward's matmuls (plain, through a packed weight, or on CPU inside
    # the fused decoder layers)
    assert recorder.names & {"mm", "addmm", "linear", "_linear_pointwise", "packed_linear", "decoder_layer"}
    assert not recorder.names & set(SYNCING_OPS), sorted(recorder.names & set(SYNCING_OPS))
