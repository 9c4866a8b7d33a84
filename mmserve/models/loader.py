"""Build a model from a Hugging Face folder: config → module → safetensors weights, by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.config import ModelConfig
from mmserve.layers.attention import AttentionBackend
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
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name).to(dtype)


def load_model(config: ModelConfig, backend: AttentionBackend, device: torch.device) -> nn.Module:
    """Instantiate the architecture on `device` in `config.dtype` and fill it from the folder."""
    cls = model_class(config.architecture, config.family)
    with torch.device(device):
        model = cls(config, backend)
    model.to(dtype=config.dtype)
    model.load_weights(iterate_weights(config.path, config.dtype))
    # Rotary tables stay float32 whatever the model dtype: they are computed, not loaded.
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(module, name, buf.float())
    return model.eval()
