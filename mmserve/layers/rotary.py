"""Rotary position embeddings: M-RoPE for the language model, 2-D RoPE for the vision tower.

M-RoPE gives every token three position ids (temporal, height, width; which ids a prompt's
tokens get is its model family's business) and drives each section of the rotary frequencies
(`mrope_section`) by one of them, in consecutive sections or interleaved channel by channel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.layers.kernel_user import UsesKernels


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """[dim / 2] float32 inverse frequencies of standard RoPE over `dim` channels."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class MRotaryEmbedding(UsesKernels, nn.Module):
    """Applies M-RoPE to queries and keys given [3, num_tokens] positions.

    cos/sin per position are cached up to `max_positions`; the cached values are computed exactly
    as an on-the-fly float32 `position * inv_freq` would be, so results match bit for bit.
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: Sequence[int], max_positions: int) -> None:
        super().__init__()
        if 2 * sum(mrope_section) != head_dim:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim/2 = {head_dim // 2}")
        self.head_dim = head_dim
        self.mrope_section = list(mrope_section)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inverse_frequencies(
            head_dim, theta
        )
        # cos/sin cache: [max_positions, head_dim / 2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        # Which of the three position rows drives each frequency channel: [head_dim / 2]
        section_of_channel = torch.cat(
            [torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(self.mrope_section)]
        )
        self.register_buffer("section_of_channel", section_of_channel, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D] → rotated q, k (same shapes and dtype; possibly the same
        tensors, rotated in place). Positions must be below `max_positions` (the runner's are:
        they never exceed the token index, and the table covers the model length)."""
        return self.kernels.mrope(q, k, positions, self.cos_cache, self.sin_cache, self.section_of_channel)


def interleaved_sections(mrope_section: Sequence[int]) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) drives each of the head_dim / 2 frequency channels:
    channel c follows h when c ≡ 1 (mod 3) and c < 3·section_h, w when c ≡ 2 (mod 3) and
    c < 3·section_w, t otherwise. [head_dim / 2] int64."""
    channels = torch.arange(sum(mrope_section))
    rows = torch.zeros_like(channels)
    for row in (1, 2):
        rows[(channels % 3 == row) & (channels < 3 * mrope_section[row])] = row
    return rows


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE with the t/h/w channels interleaved (`interleaved_sections`); everything else as
    `MRotaryEmbedding`."""

    def __init__(self, head_dim: int, theta: float, mrope_section: Sequence[int], max_positions: int) -> None:
        super().__init__(head_dim, theta, mrope_section, max_positions)
        self.section_of_channel.copy_(interleaved_sections(mrope_section))


def vision_patch_positions(grid_thw: Sequence[tuple[int, int, int]], spatial_merge_size: int) -> torch.Tensor:
    """(row, col) of every patch in the order the processor emits them: [num_patches, 2] int64.

    Patches come in merge-block order (each spatial_merge_size² block contiguous), repeated per frame.
    """
    out = []
    m = spatial_merge_size
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        rows = rows.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        cols = cols.reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


class VisionRotary(UsesKernels, nn.Module):
    """Applies the 2-D RoPE angles `VisionRotaryEmbedding.cos_sin` gives to queries or keys."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, H, D], cos/sin: [N, D / 2] → rotated x (same shape and dtype)."""
        return self.kernels.vision_rotary(x, cos, sin)


class VisionRotaryEmbedding(nn.Module):
    """2-D RoPE of the vision tower: half the channels follow the row, half the column."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim // 2, theta), persistent=False)

    def cos_sin(self, patch_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """patch_positions: [N, 2] → cos, sin: [N, head_dim / 2] float32, the angles of the row
        channels then the column channels (what the kernel sets' `vision_rotary` takes)."""
        freqs = patch_positions[..., None].float() * self.inv_freq  # [N, 2, head_dim/4]
        freqs = freqs.flatten(1)  # [N, head_dim/2]
        return freqs.cos(), freqs.sin()
