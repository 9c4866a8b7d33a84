"""Build a model from a Hugging Face folder: config → module → safetensors weights, by name.

Each rank of a tensor-parallel model reads only its shard of each tensor: the checkpoint's
tensors are handed over as `CheckpointTensor`s over safetensors slices, read as far as the
parameter's loader asks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.config import ModelConfig
from mmserve.layers.weights import CheckpointTensor
from mmserve.models.registry import family_named


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards, in the index's order when sharded."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def iterate_weights(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, CheckpointTensor]]:
    """Checkpoint tensors one at a time, read lazily and converted to `dtype` (at most one
    tensor's slice of extra memory at a time, never a second copy of the model). Each is valid
    until the next is yielded."""
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                handle = f.get_slice(name)
                yield name, CheckpointTensor(tuple(handle.get_shape()), handle.__getitem__, dtype)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(config: ModelConfig, device: torch.device, encoder_data_parallel: bool = False) -> nn.Module:
    """Instantiate the family's model (this rank's shard of it) on `device` directly in
    `config.dtype` (parameters are born in their final dtype, so loading peaks at the model's
    size, not twice it) and fill it from the folder. `encoder_data_parallel`: the vision tower
    whole on every rank instead of split. The model runs the torch reference kernels until a
    kernel plan is applied to it (mmserve/worker/kernel_plan.py)."""
    cls = family_named(config.family).model_class()
    dtype = getattr(torch, config.dtype)
    with torch.device(device), _default_dtype(dtype):
        model = cls(config, encoder_data_parallel)
    model.load_weights(iterate_weights(config.path, dtype))
    # Rotary tables stay float32 whatever the model dtype: they are computed, not loaded.
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(module, name, buf.float())
    return model.eval()
