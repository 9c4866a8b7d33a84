"""How a parameter is filled from a checkpoint tensor that is read only as far as it is needed.

A `CheckpointTensor` knows its full shape and reads a slice on request, so a rank of a
tensor-parallel model reads only its shard of each weight from the safetensors file (the file's
other bytes are never touched). Every parameter that is sharded carries a `weight_loader`
attribute; `load_parameter` calls it, or copies the whole tensor for replicated parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Reader = Callable[[tuple[slice, ...]], torch.Tensor]


class CheckpointTensor:
    """One checkpoint tensor: `shape` up front, the values read slice by slice in `dtype`.
    Valid only while its file is open (the loader hands each one over inside that window)."""

    def __init__(self, shape: tuple[int, ...], read: Reader, dtype: torch.dtype) -> None:
        self.shape = torch.Size(shape)
        self._read = read
        self.dtype = dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> CheckpointTensor:
        """An in-memory tensor behind the same interface (tests, converted checkpoints)."""
        return cls(tuple(tensor.shape), tensor.__getitem__, tensor.dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows [start, start + length) of dimension `dim`; only those are read."""
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"slice [{start}, {start + length}) outside dimension {dim} of {tuple(self.shape)}"
            )
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._read(index).to(self.dtype)

    def full(self) -> torch.Tensor:
        return self._read((slice(None),) * len(self.shape)).to(self.dtype)


def check_shape(name: str, expected: tuple[int, ...] | torch.Size, loaded: CheckpointTensor) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: CheckpointTensor) -> None:
    """A replicated parameter: the whole tensor, of exactly the parameter's shape."""
    check_shape("tensor", param.shape, loaded)
    param.data.copy_(loaded.full())


def load_parameter(param: nn.Parameter, loaded: CheckpointTensor, shard_id: Any = None) -> None:
    """Fill `param` from `loaded` by its own loader (a shard of a split or fused parameter) or
    whole. `shard_id` names the part of a fused parameter the tensor is (q/k/v, gate/up)."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        if shard_id is not None:
            raise ValueError(f"shard {shard_id!r} given for a parameter that is not fused")
        default_weight_loader(param, loaded)
    elif shard_id is None:
        loader(param, loaded)
    else:
        loader(param, loaded, shard_id)
