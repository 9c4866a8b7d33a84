"""Tensor-parallel layers without processes: each rank's shard is built under a group of the
right rank and size (no communication is needed to build or load), and the sum or concatenation
the collectives would compute is done here by hand, against the unsplit layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.distributed.parallel_state import TensorParallelGroup, use_tp_group
from mmserve.distributed.partition import first_kv_head, kv_heads_per_rank, vocab_per_rank
from mmserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mmserve.layers.vocab_embedding import ParallelLMHead
from mmserve.layers.weights import CheckpointTensor, load_parameter
from mmserve.models.vision_data_parallel import deal_items


def shards(world_size: int, build):
    """build() once per rank, under that rank's (communication-free) group."""
    built = []
    for rank in range(world_size):
        with use_tp_group(TensorParallelGroup(rank, world_size, process_group=None)):
            built.append(build())
    return built


@pytest.mark.parametrize(
    ("num_kv_heads", "world_size", "per_rank", "firsts"),
    [(4, 2, 2, [0, 2]), (2, 4, 1, [0, 0, 1, 1]), (1, 3, 1, [0, 0, 0]), (3, 3, 1, [0, 1, 2])],
)
def test_kv_heads_split_or_replicate(num_kv_heads, world_size, per_rank, firsts):
    assert kv_heads_per_rank(num_kv_heads, world_size) == per_rank
    assert [first_kv_head(r, num_kv_heads, world_size) for r in range(world_size)] == firsts


@pytest.mark.parametrize(("num_kv_heads", "world_size"), [(4, 3), (2, 3), (3, 2)])
def test_kv_heads_that_neither_divide_nor_replicate_are_refused(num_kv_heads, world_size):
    with pytest.raises(ValueError, match="does not split evenly"):
        kv_heads_per_rank(num_kv_heads, world_size)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "world_size"), [(4, 2, 2), (6, 1, 3), (4, 2, 4)])
def test_qkv_shards_hold_each_ranks_heads(num_heads, num_kv_heads, world_size):
    torch.manual_seed(0)
    hidden, head_dim = 24, 8
    q_w = torch.randn(num_heads * head_dim, hidden)
    k_w, v_w = torch.randn(2, num_kv_heads * head_dim, hidden)
    bias = [torch.randn(num_heads * head_dim), *torch.randn(2, num_kv_heads * head_dim)]
    layers = shards(world_size, lambda: QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads))
    x = torch.randn(5, hidden)
    q_per_rank = num_heads // world_size
    for rank, layer in enumerate(layers):
        for shard, (w, b) in enumerate(zip((q_w, k_w, v_w), bias)):
            load_parameter(layer.weight, CheckpointTensor.of(w), shard)
            load_parameter(layer.bias, CheckpointTensor.of(b), shard)
        kv_size = layer.num_kv_heads * head_dim
        q, k, v = layer(x).split([q_per_rank * head_dim, kv_size, kv_size], dim=-1)
        heads = slice(rank * q_per_rank * head_dim, (rank + 1) * q_per_rank * head_dim)
        kv_first = first_kv_head(rank, num_kv_heads, world_size) * head_dim
        kv = slice(kv_first, kv_first + kv_size)
        torch.testing.assert_close(q, F.linear(x, q_w[heads], bias[0][heads]))
        torch.testing.assert_close(k, F.linear(x, k_w[kv], bias[1][kv]))
        torch.testing.assert_close(v, F.linear(x, v_w[kv], bias[2][kv]))


def test_column_then_row_parallel_sums_to_the_unsplit_mlp():
    """gate/up column-parallel, down row-parallel: the ranks' partial outputs sum to the whole
    (the all-reduce), and a fused checkpoint tensor loads like its separate parts."""
    torch.manual_seed(1)
    hidden, inter, world_size = 16, 12, 3
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    x = torch.randn(4, hidden)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    partial_sums = torch.zeros_like(expected)
    for gate_up, row in zip(
        shards(world_size, lambda: MergedColumnParallelLinear(hidden, [inter, inter], bias=False)),
        shards(world_size, lambda: RowParallelLinear(inter, hidden, bias=False)),
    ):
        load_parameter(gate_up.weight, CheckpointTensor.of(torch.cat([gate, up])))  # fused
        load_parameter(row.weight, CheckpointTensor.of(down))
        g, u = gate_up(x).chunk(2, dim=-1)
        partial_sums += F.linear(F.silu(g) * u, row.weight)
    torch.testing.assert_close(partial_sums, expected, rtol=1e-5, atol=1e-4)  # summed in another order


def test_vocab_parallel_lm_head_pads_the_last_rank():
    torch.manual_seed(2)
    vocab, hidden, world_size = 10, 6, 3
    table = torch.randn(vocab, hidden)
    heads = shards(world_size, lambda: ParallelLMHead(vocab, hidden))
    assert vocab_per_rank(vocab, world_size) == 4
    for head in heads:
        load_parameter(head.weight, CheckpointTensor.of(table))
    assert torch.equal(heads[2].weight[2:], torch.zeros(2, hidden)), "padding rows are zero"
    x = torch.randn(3, hidden)
    gathered = torch.cat([F.linear(x, head.weight) for head in heads], dim=-1)[:, :vocab]
    torch.testing.assert_close(gathered, F.linear(x, table))


def test_checkpoint_tensor_reads_only_the_slice_asked_for():
    reads = []
    full = torch.arange(24.0).view(6, 4)

    def read(index):
        reads.append(index)
        return full[index]

    tensor = CheckpointTensor((6, 4), read, torch.float32)
    assert torch.equal(tensor.narrow(1, 2, 2), full[:, 2:4])
    assert reads == [(slice(None), slice(2, 4))]
    with pytest.raises(ValueError, match="outside dimension"):
        tensor.narrow(0, 5, 2)


def test_images_are_dealt_to_balance_patches():
    assert deal_items([64, 16, 16, 16, 16], 2) == [[0], [1, 2, 3, 4]]
    assert deal_items([4], 3) == [[0], [], []]
