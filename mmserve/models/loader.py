"""Build a model from a Hugging Face folder: config → module → safetensors weights, by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.config import ModelConfig
from mmserve.layers.attention import AttentionBackend
from mmserve.layers.kernel_user import use_kernels
from mmserve.models.registry import model_class


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


def iterate_weights(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors one at a time, each converted to `dtype` (one tensor's worth of extra
    memory at a time, never a second copy of the model)."""
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name).to(dtype)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(config: ModelConfig, backend: AttentionBackend, device: torch.device) -> nn.Module:
    """Instantiate the architecture on `device` directly in `config.dtype` (parameters are born
    in their final dtype, so loading peaks at the model's size, not twice it), fill it from the
    folder, and give its layers the backend's kernel set."""
    cls = model_class(config.architecture, config.family)
    with torch.device(device), _default_dtype(config.dtype):
        model = cls(config, backend)
    model.load_weights(iterate_weights(config.path, config.dtype))
    # Rotary tables stay float32 whatever the model dtype: they are computed, not loaded.
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(module, name, buf.float())
    use_kernels(model, backend.kernels)
    return model.eval()
