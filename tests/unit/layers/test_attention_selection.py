"""Which attention backend `--attention-backend` gives on which device, dtype and block size.

flash-attn cannot be installed here; where a test needs it importable, `is_installed` is
patched (the selection logic is what is under test, not flash-attn)."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.attention import resolve_attention_backend
from mmserve.ops import cpu
from mmserve.ops import flash_attn as flash_attn_ops
from mmserve.ops import triton as triton_ops

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.fixture
def flash_attn_installed(monkeypatch):
    monkeypatch.setattr(flash_attn_ops, "is_installed", lambda: True)


@pytest.fixture
def triton_installed(monkeypatch):
    monkeypatch.setattr(triton_ops, "is_available", lambda: True)


def test_auto_on_cpu_is_the_cpp_kernels_whatever_is_installed(flash_attn_installed):
    expected = "cpu" if cpu.is_available() else "torch"
    assert resolve_attention_backend("auto", CPU) == expected
    assert resolve_attention_backend("auto", CPU, torch.bfloat16, 256) == expected


def test_auto_on_cuda_picks_flash_attn_where_it_imports_and_fits(flash_attn_installed, triton_installed):
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, 256) == "flash_attn"
    assert resolve_attention_backend("auto", CUDA, torch.float16, 512) == "flash_attn"


@pytest.mark.parametrize(("dtype", "block_size"), [(torch.float32, 256), (torch.bfloat16, 16)])
def test_auto_on_cuda_is_triton_where_flash_attn_does_not_fit(
    flash_attn_installed, triton_installed, dtype, block_size
):
    assert resolve_attention_backend("auto", CUDA, dtype, block_size) == "triton"


def test_auto_on_cuda_without_flash_attn_is_triton(triton_installed, monkeypatch):
    monkeypatch.setattr(flash_attn_ops, "is_installed", lambda: False)
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, 256) == "triton"


def test_auto_on_cuda_without_triton_is_the_reference(monkeypatch):
    monkeypatch.setattr(flash_attn_ops, "is_installed", lambda: False)
    monkeypatch.setattr(triton_ops, "is_available", lambda: False)
    assert resolve_attention_backend("auto", CUDA, torch.bfloat16, 16) == "torch"


def test_flash_attn_asked_for_but_missing_says_so():
    assert not flash_attn_ops.is_installed()  # true on this machine: nothing is patched here
    with pytest.raises(
        ValueError, match="flash_attn cannot run here: the flash_attn package is not installed"
    ):
        resolve_attention_backend("flash_attn", CUDA, torch.bfloat16, 256)


@pytest.mark.parametrize(
    ("device", "dtype", "block_size", "reason"),
    [
        (CPU, torch.bfloat16, 256, "CUDA devices only"),
        (CUDA, torch.float32, 256, "float16 or bfloat16"),
        (CUDA, torch.bfloat16, 16, "multiple of 256"),
    ],
)
def test_flash_attn_where_it_cannot_run_names_the_reason(
    flash_attn_installed, device, dtype, block_size, reason
):
    with pytest.raises(ValueError, match=reason):
        resolve_attention_backend("flash_attn", device, dtype, block_size)


def test_flash_attn_without_triton_names_triton(flash_attn_installed, monkeypatch):
    monkeypatch.setattr(triton_ops, "is_available", lambda: False)
    with pytest.raises(ValueError, match="Triton"):
        resolve_attention_backend("flash_attn", CUDA, torch.bfloat16, 256)


def test_explicit_names_pass_through_and_unknown_ones_fail():
    assert resolve_attention_backend("triton", CUDA) == "triton"
    assert resolve_attention_backend("torch", CPU) == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_attention_backend("xformers", CUDA)
