"""Rotary position embeddings: M-RoPE for the language model, 2-D RoPE for the vision tower.

M-RoPE gives every token three position ids (temporal, height, width). Text tokens carry the
same id in all three; an image's tokens carry (t, row, col) offsets from the position where the
image starts, and the text after an image resumes at start + max(rows, cols). Each third of the
rotary frequencies (`mrope_section`) is driven by one of the three ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """[dim / 2] float32 inverse frequencies of standard RoPE over `dim` channels."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class MRotaryEmbedding(nn.Module):
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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T] int64 → cos, sin: [T, 1, head_dim] in `dtype` (broadcast over heads)."""
        if positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} beyond the rotary cache ({self.cos_cache.shape[0]})"
            )
        channels = torch.arange(self.head_dim // 2, device=positions.device)
        # per token and channel, the position from the row that drives that channel: [T, head_dim/2]
        pos = positions[self.section_of_channel, :].T
        cos = self.cos_cache[pos, channels]
        sin = self.sin_cache[pos, channels]
        cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
        sin = torch.cat((sin, sin), dim=-1).to(dtype)[:, None, :]
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D] → rotated q, k (same shapes and dtype)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def mrope_input_positions(
    num_tokens: int,
    images: Sequence[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
    time_intervals: Sequence[float] | None = None,
) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a prompt and the delta that continues them for generated tokens.

    images: (offset of the first placeholder token, number of placeholder tokens, (t, h, w) patch grid)
    per image or video, in prompt order. `time_intervals` (one per item, default 1) spaces the
    temporal positions of a video: temporal patch i sits at ⌊i · interval⌋ computed in float32,
    as transformers does for Qwen2.5-VL. Returns positions [3, num_tokens] int64 and `delta`
    such that the token at index i ≥ num_tokens has position i + delta in all three rows.
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    next_pos = 0
    text_start = 0
    intervals = time_intervals if time_intervals is not None else [1.0] * len(images)
    for (offset, length, (t, h, w)), interval in zip(images, intervals, strict=True):
        text_len = offset - text_start
        positions[:, text_start:offset] = next_pos + np.arange(text_len)
        next_pos += text_len
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        if t * rows * cols != length:
            raise ValueError(
                f"image at {offset} has {length} placeholder tokens but its grid gives {t * rows * cols}"
            )
        temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(temporal, np.arange(rows), np.arange(cols), indexing="ij")
        positions[:, offset : offset + length] = next_pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        next_pos += max(rows, cols)
        text_start = offset + length
    positions[:, text_start:] = next_pos + np.arange(num_tokens - text_start)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


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


class VisionRotaryEmbedding(nn.Module):
    """2-D RoPE of the vision tower: half the channels follow the row, half the column."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim // 2, theta), persistent=False)

    def cos_sin(self, patch_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """patch_positions: [N, 2] → cos, sin: [N, 1, head_dim] float32."""
        freqs = patch_positions[..., None].float() * self.inv_freq  # [N, 2, head_dim/4]
        freqs = freqs.flatten(1)  # [N, head_dim/2]: row channels, then column channels
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D] in any dtype; rotated in float32 (as the reference does) and cast back."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
