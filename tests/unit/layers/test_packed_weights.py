"""Packing linear weights after loading: same outputs, one copy of each weight, tied weights
kept for their other user, excluded modules left plain, each tensor-parallel shard packed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmserve.distributed.parallel_state import TensorParallelGroup, use_tp_group
from mmserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from mmserve.layers.packed_weights import pack_linear_weights, weight_bytes
from mmserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from mmserve.layers.weights import CheckpointTensor, load_parameter
from mmserve.ops import linear, reference
from mmserve.worker.kernel_plan import cpu_linear_method


class Tiny(nn.Module):
    """An embedding with a tied LM head, an MLP, and an untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(48, 16)
        self.tied_head = ParallelLMHead(48, 16)
        self.tied_head.weight = self.embed.weight
        self.up = ColumnParallelLinear(16, 32)
        self.down = RowParallelLinear(32, 16, bias=False)
        self.head = ParallelLMHead(48, 16)


def loaded(dtype: torch.dtype) -> Tiny:
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Tiny().to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    return model


def outputs(model: Tiny, ids: torch.Tensor) -> list[torch.Tensor]:
    x = model.embed(ids)  # [T, 16]
    mlp = model.down(model.up(x))
    return [mlp, model.tied_head.compute_logits(x), model.head.compute_logits(mlp)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_compute_what_the_plain_ones_did(dtype):
    model = loaded(dtype)
    ids = torch.tensor([1, 5, 47, 0, 7])
    with torch.no_grad():
        want = outputs(model, ids)
        assert pack_linear_weights(model, cpu_linear_method) == 4
        got = outputs(model, ids)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-3}
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance)


def test_packing_drops_plain_weights_but_keeps_a_tied_one():
    model = loaded(torch.bfloat16)
    before = weight_bytes(model)
    pack_linear_weights(model, cpu_linear_method)
    assert model.up.weight is None and model.down.weight is None and model.head.weight is None
    assert model.tied_head.weight is model.embed.weight  # the embedding still looks rows up
    assert model.up.bias is not None
    tied_copy = 48 * 16 * 2
    assert weight_bytes(model) == before + tied_copy


def test_layers_under_keep_plain_are_not_packed():
    model = loaded(torch.float32)
    mlp = nn.ModuleList([model.up, model.down])
    pack_linear_weights(model, cpu_linear_method, keep_plain=mlp)
    assert model.up.linear_method is None and model.up.weight is not None
    assert model.head.linear_method is not None


def test_layers_under_large_rows_only_are_packed_for_large_row_counts():
    model = loaded(torch.float32)
    mlp = nn.ModuleList([model.up, model.down])
    calls = []

    def pack(weight: torch.Tensor, small_rows: bool) -> linear.LinearMethod:
        calls.append((weight.shape, small_rows))
        return cpu_linear_method(weight, small_rows)

    pack_linear_weights(model, pack, large_rows_only=mlp)
    assert sorted(calls) == sorted([((48, 16), True), ((32, 16), False), ((16, 32), False), ((48, 16), True)])
    assert isinstance(model.head.linear_method, linear.PanelLinear)
    with torch.no_grad():
        ids = torch.tensor([3, 9])
        x = model.embed(ids)
        torch.testing.assert_close(
            model.down(model.up(x)), loaded(torch.float32).down(loaded(torch.float32).up(x))
        )


def test_no_pack_function_leaves_every_layer_plain():
    model = loaded(torch.float32)
    assert pack_linear_weights(model, None) == 0
    assert all(getattr(m, "linear_method", None) is None for m in model.modules())


def test_each_tensor_parallel_rank_packs_its_own_slice():
    torch.manual_seed(3)
    weight, x = torch.randn(24, 16).bfloat16(), torch.randn(3, 16).bfloat16()
    parts = []
    for rank in range(2):
        with use_tp_group(TensorParallelGroup(rank, 2, process_group=None)):
            layer = ColumnParallelLinear(16, 24, bias=False).bfloat16()
        load_parameter(layer.weight, CheckpointTensor.of(weight))
        pack_linear_weights(layer, cpu_linear_method)
        assert layer.linear_method.out_features == 12
        parts.append(layer(x))
    torch.testing.assert_close(torch.cat(parts, -1), reference.linear(x, weight), rtol=2**-7, atol=1e-3)
