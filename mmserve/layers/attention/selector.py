"""Which attention backend runs a model: `--attention-backend`, with `auto` resolved for the
device, the model dtype and the KV block size."""

from __future__ import annotations

import torch

from mmserve.config import ATTENTION_BACKENDS
from mmserve.layers.attention.backend import AttentionBackend


def resolve_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, block_size: int = 16
) -> str:
    """`auto` → the fastest backend that works for the device, model dtype and KV block size:
    on CPU the C++ kernels (torch if they cannot be built here); on CUDA flash-attn where it is
    installed and supports the dtype and block size, else Triton, else torch. Other names are
    checked; `flash_attn` where it cannot run raises with the reason."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "flash_attn":
        reason = _flash_attn_unsupported(device, dtype, block_size)
        if reason is not None:
            raise ValueError(f"--attention-backend flash_attn cannot run here: {reason}")
    if name != "auto":
        return name
    if device.type == "cpu":
        from mmserve.ops import cpu

        return "cpu" if cpu.is_available() else "torch"
    if _flash_attn_unsupported(device, dtype, block_size) is None:
        return "flash_attn"
    from mmserve.ops import triton as triton_ops

    return "triton" if triton_ops.is_available() else "torch"


def _flash_attn_unsupported(device: torch.device, dtype: torch.dtype, block_size: int) -> str | None:
    """Why the flash_attn backend cannot run here, or None (it also needs Triton, for the KV
    write and the other layers' kernels)."""
    from mmserve.ops import flash_attn

    reason = flash_attn.unsupported_reason(device, dtype, block_size)
    if reason is None:
        from mmserve.ops import triton as triton_ops

        if not triton_ops.is_available():
            reason = "it stores keys and values with Triton, which is not installed"
    return reason


def get_attention_backend(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32, block_size: int = 16
) -> AttentionBackend:
    """The backend called `name` (see `resolve_attention_backend` for `auto`)."""
    name = resolve_attention_backend(name, device, dtype, block_size)
    if name == "torch":
        from mmserve.layers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from mmserve.layers.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "flash_attn":
        from mmserve.layers.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    from mmserve.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
