"""The Qwen2-VL vision tower: a ViT with 2-D RoPE and a 2×2 patch merger.

It turns an image's patches ([num_patches, C·T·P·P], in the processor's merge-block order)
into one embedding per merged 2×2 block. Under tensor parallelism the tower is split like the
language model (heads and MLP widths over the ranks), or built on the group of one rank where
it is replicated (`encoder_data_parallel`, see model.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.distributed.parallel_state import TensorParallelGroup
from mmserve.layers.activation import Activation
from mmserve.layers.attention.encoder import EncoderAttention
from mmserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mmserve.layers.packed_weights import PatchProjection
from mmserve.layers.rotary import VisionRotary, VisionRotaryEmbedding, vision_patch_positions
from mmserve.models.qwen2_vl.config import VisionConfig

Grid = tuple[int, int, int]


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride = kernel is a matmul over flattened patches."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = PatchProjection(vision.dim, vision.in_channels, kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)  # [patches, dim]


class VisionAttention(nn.Module):
    """The checkpoint's qkv is one fused tensor ([q; k; v], each all heads); a rank holds its
    heads' rows of each part."""

    def __init__(self, dim: int, num_heads: int, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.qkv = QKVParallelLinear(dim, self.head_dim, num_heads, num_heads, bias=True, group=group)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.rotary = VisionRotary()
        self.attn = EncoderAttention(scale=self.head_dim**-0.5)
        self.proj = RowParallelLinear(dim, dim, bias=True, group=group)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, H, D]
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        out = self.attn(q, k, v, cu_seqlens)  # [N, H, D]
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, group=group)
        self.fc2 = RowParallelLinear(hidden, dim, group=group)
        self.act = Activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    mlp_class: type[nn.Module] = VisionMLP

    def __init__(self, vision: VisionConfig, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(vision.dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(vision.dim, eps=1e-6)
        self.attn = VisionAttention(vision.dim, vision.num_heads, group)
        self.mlp = self.mlp_class(vision.dim, vision.mlp_dim, vision.hidden_act, group)

    def forward(self, x, cos, sin, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each merge block's patches and projects them to the language model width."""

    def __init__(
        self, vision: VisionConfig, norm: nn.Module, group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.merged_dim = vision.dim * vision.spatial_merge_size**2
        self.ln_q = norm
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.merged_dim, self.merged_dim, group=group),
            nn.GELU(),
            RowParallelLinear(self.merged_dim, vision.out_dim, group=group),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


def image_cu_seqlens(grid_thw: Sequence[Grid]) -> list[int]:
    """Each frame of each image attends only within itself."""
    cu = [0]
    for t, h, w in grid_thw:
        start = cu[-1]  # (read once: extending from a generator that reads cu[-1] would compound)
        cu.extend(start + h * w * (i + 1) for i in range(t))
    return cu


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, vision: VisionConfig, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = vision
        self.output_width = vision.out_dim  # of each merged token
        self.patch_embed = PatchEmbed(vision)
        self.rotary = VisionRotaryEmbedding(vision.head_dim, vision.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(vision, group) for _ in range(vision.depth))
        self.merger = PatchMerger(vision, nn.LayerNorm(vision.dim, eps=1e-6), group)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Grid]) -> torch.Tensor:
        """pixel_values: [num_patches, C·T·P·P] → [num_patches / merge², out_dim]."""
        x = self.patch_embed(pixel_values)
        positions = vision_patch_positions(grid_thw, self.config.spatial_merge_size).to(x.device)
        cos, sin = self.rotary.cos_sin(positions)
        cu_seqlens = image_cu_seqlens(grid_thw)
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens)
        return self.merger(x)


def one_width(pixel_values: list[torch.Tensor], channels: int) -> list[torch.Tensor]:
    """Items' pixels that concatenate: where still images (one frame per row, C·P·P) meet
    videos (C·T·P·P) in one step, the images' frames repeated over T, as the patch projection
    would repeat them (it takes either width, not a mix)."""
    widest = max(p.shape[1] for p in pixel_values)
    widened = []
    for pixels in pixel_values:
        if pixels.shape[1] != widest:
            temporal = widest // pixels.shape[1]
            rows = pixels.shape[0]
            frames = pixels.reshape(rows, channels, 1, -1).expand(-1, -1, temporal, -1)  # [N, C, T, P·P]
            pixels = frames.reshape(rows, widest)
        widened.append(pixels)
    return widened
