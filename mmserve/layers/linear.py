"""Linear layers split across a tensor-parallel group (Megatron's column/row pattern, as vLLM's).

A column-parallel layer holds a slice of the output features: its output stays split, and the
next layer must be row-parallel. A row-parallel layer holds the matching slice of the input
features and sums its partial products over the ranks (one all-reduce), then adds its bias once.
Fused layers (q/k/v, gate/up) hold, per rank, the rank's slice of each part side by side, so a
rank's output splits into its own q, k and v exactly as the unsplit layer's does.

On a group of one rank every layer is one matmul over the whole weight: `F.linear` as loaded,
or the method its weight was packed for after loading (`mmserve.layers.packed_weights`); each
rank packs its own slice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.distributed.parallel_state import TensorParallelGroup, get_tp_group
from mmserve.distributed.partition import divide, first_kv_head, kv_heads_per_rank
from mmserve.layers.packed_weights import PacksWeight
from mmserve.layers.weights import CheckpointTensor, check_shape


class _Linear(PacksWeight, nn.Module):
    """weight [out_local, in_local] (+ bias [out_local]) on `group`, filled by `weight_loader`."""

    def __init__(self, in_local: int, out_local: int, bias: bool, group: TensorParallelGroup | None) -> None:
        super().__init__()
        self.group = group or get_tp_group()
        self.weight = nn.Parameter(torch.empty(out_local, in_local))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_Linear):
    """y[:, rank's slice] = x W[rank's rows]ᵀ + b[rank's slice]; the output stays split."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, group: TensorParallelGroup | None = None
    ) -> None:
        group = group or get_tp_group()
        self.output_size = output_size
        self.output_per_rank = divide(output_size, group.world_size, "output size")
        super().__init__(input_size, self.output_per_rank, bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        check_shape("column-parallel tensor", (self.output_size, *param.shape[1:]), loaded)
        n = self.output_per_rank
        param.data.copy_(loaded.narrow(0, self.group.rank * n, n))


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel layers over the same input in one matmul (gate/up; a checkpoint's
    fused q/k/v). Part i of the checkpoint is `output_sizes[i]` rows; each rank holds its slice
    of every part, in order."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = True,
        group: TensorParallelGroup | None = None,
    ) -> None:
        group = group or get_tp_group()
        self.output_sizes = list(output_sizes)
        self.local_sizes = [self._local_size(i, group) for i in range(len(self.output_sizes))]
        super().__init__(input_size, sum(self.local_sizes), bias, group)

    def _local_size(self, shard: int, group: TensorParallelGroup) -> int:
        return divide(self.output_sizes[shard], group.world_size, "output size")

    def _source_start(self, shard: int) -> int:
        """First row of this rank's slice within part `shard` of the checkpoint tensor."""
        return self.group.rank * self.local_sizes[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int | None = None
    ) -> None:
        """One part (`shard_id`), or with no shard id the whole fused tensor: every part at once."""
        if shard_id is None:
            check_shape("fused tensor", (sum(self.output_sizes), *param.shape[1:]), loaded)
            shards = range(len(self.output_sizes))
            bases = [sum(self.output_sizes[:i]) for i in shards]
        else:
            shards, bases = [shard_id], {shard_id: 0}
            check_shape(f"part {shard_id}", (self.output_sizes[shard_id], *param.shape[1:]), loaded)
        for shard in shards:
            offset, n = sum(self.local_sizes[:shard]), self.local_sizes[shard]
            param.data.narrow(0, offset, n).copy_(
                loaded.narrow(0, bases[shard] + self._source_start(shard), n)
            )


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections fused; query heads split over the ranks, KV heads split or (fewer KV
    heads than ranks) replicated. Parts are 0/1/2 = q/k/v."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = True,
        group: TensorParallelGroup | None = None,
    ) -> None:
        group = group or get_tp_group()
        self.head_dim = head_dim
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, group.world_size, "the attention head count")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, group.world_size)
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, group)

    def _local_size(self, shard: int, group: TensorParallelGroup) -> int:
        return (self.num_heads if shard == 0 else self.num_kv_heads) * self.head_dim

    def _source_start(self, shard: int) -> int:
        if shard == 0:
            return self.group.rank * self.local_sizes[0]
        return first_kv_head(self.group.rank, self.total_num_kv_heads, self.group.world_size) * self.head_dim


class RowParallelLinear(_Linear):
    """y = Σ_ranks x[:, rank's slice] W[:, rank's columns]ᵀ, then + b: the input arrives split
    (a column-parallel layer's output), the output is whole on every rank."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, group: TensorParallelGroup | None = None
    ) -> None:
        group = group or get_tp_group()
        self.input_size = input_size
        self.input_per_rank = divide(input_size, group.world_size, "input size")
        super().__init__(self.input_per_rank, output_size, bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return self.matmul(x, self.bias)
        y = self.group.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        if param.ndim == 1:  # the bias is added once, after the sum: every rank holds all of it
            check_shape("row-parallel bias", param.shape, loaded)
            param.data.copy_(loaded.full())
            return
        check_shape("row-parallel tensor", (param.shape[0], self.input_size), loaded)
        n = self.input_per_rank
        param.data.copy_(loaded.narrow(1, self.group.rank * n, n))
