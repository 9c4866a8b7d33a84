"""Qwen2.5-VL: Qwen2-VL with an RMSNorm/SwiGLU vision tower and window attention.

Most vision blocks attend only within windows of `window_size` pixels (in merged-token units,
window_size / patch / merge tokens on a side); the blocks listed in `fullatt_block_indexes`
attend over the whole image. Patches are permuted so that each window is contiguous, in whole
merge blocks, and permuted back after the merger.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from mmserve.distributed.parallel_state import TensorParallelGroup
from mmserve.layers.activation import get_activation
from mmserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import VisionRotaryEmbedding, vision_patch_positions
from mmserve.models.qwen2_vl.config import VisionConfig
from mmserve.models.qwen2_vl.model import Qwen2VLForConditionalGeneration
from mmserve.models.qwen2_vl.vision import Grid, PatchEmbed, PatchMerger, VisionAttention, image_cu_seqlens


class GatedVisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, hidden, group=group)
        self.up_proj = ColumnParallelLinear(dim, hidden, group=group)
        self.down_proj = RowParallelLinear(hidden, dim, group=group)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5VisionBlock(nn.Module):
    def __init__(self, vision: VisionConfig, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vision.dim, eps=1e-6)
        self.norm2 = RMSNorm(vision.dim, eps=1e-6)
        self.attn = VisionAttention(vision.dim, vision.num_heads, group)
        self.mlp = GatedVisionMLP(vision.dim, vision.mlp_dim, vision.hidden_act, group)

    def forward(self, x, cos, sin, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


def window_partition(
    grid_thw: Sequence[Grid], spatial_merge_size: int, window_tokens: int
) -> tuple[np.ndarray, list[int]]:
    """Order of merge blocks that makes each window contiguous, and the windows' patch boundaries.

    Returns (merge-block permutation [num_blocks], cu_seqlens over patches). Windows tile each
    frame's grid of merge blocks from the top-left; edge windows are smaller.
    """
    order: list[np.ndarray] = []
    cu = [0]
    unit = spatial_merge_size**2
    base = 0
    for t, h, w in grid_thw:
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        index = np.arange(t * rows * cols).reshape(t, rows, cols)
        for frame in range(t):
            for r0 in range(0, rows, window_tokens):
                for c0 in range(0, cols, window_tokens):
                    window = index[frame, r0 : r0 + window_tokens, c0 : c0 + window_tokens].ravel()
                    order.append(window + base)
                    cu.append(cu[-1] + window.size * unit)
        base += t * rows * cols
    return np.concatenate(order), cu


class Qwen2_5VisionTransformer(nn.Module):
    def __init__(self, vision: VisionConfig, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = vision
        self.output_width = vision.out_dim  # of each merged token
        self.patch_embed = PatchEmbed(vision)
        self.rotary = VisionRotaryEmbedding(vision.head_dim, vision.rope_theta)
        self.blocks = nn.ModuleList(Qwen2_5VisionBlock(vision, group) for _ in range(vision.depth))
        self.merger = PatchMerger(vision, RMSNorm(vision.dim, eps=1e-6), group)
        self.window_tokens = vision.window_size // vision.spatial_merge_size // vision.patch_size

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Grid]) -> torch.Tensor:
        """pixel_values: [num_patches, C·T·P·P] → [num_patches / merge², out_dim]."""
        vision = self.config
        unit = vision.spatial_merge_size**2
        block_order, window_cu = window_partition(grid_thw, vision.spatial_merge_size, self.window_tokens)
        # Patch permutation: whole merge blocks move together.
        block_order_t = torch.from_numpy(block_order).to(pixel_values.device)
        patch_order = (
            block_order_t[:, None] * unit + torch.arange(unit, device=block_order_t.device)
        ).flatten()

        x = self.patch_embed(pixel_values)[patch_order]
        positions = vision_patch_positions(grid_thw, vision.spatial_merge_size).to(x.device)[patch_order]
        cos, sin = self.rotary.cos_sin(positions)
        full_cu = image_cu_seqlens(grid_thw)
        # Windows never straddle images, so per-image attention over the permuted order is
        # still attention within each image.
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_cu if i in vision.fullatt_block_indexes else window_cu)
        merged = self.merger(x)
        return merged[torch.argsort(block_order_t)]


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower_class = Qwen2_5VisionTransformer
