"""The Qwen3-VL vision tower: a ViT with learned, interpolated position embeddings and DeepStack
features.

It embeds 16-pixel patches, adds a learned position table resampled (bilinear, corners aligned)
to each frame's patch grid, and runs LayerNorm/GELU blocks with the same 2-D RoPE and per-frame
attention as Qwen2-VL. Besides the merged output of the last block, the blocks listed in
`deepstack_visual_indexes` each give a merged feature map; the language model adds feature d to
the visual tokens' hidden states after its layer d.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.distributed.parallel_state import TensorParallelGroup
from mmserve.layers.activation import get_activation
from mmserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from mmserve.layers.packed_weights import PatchProjection
from mmserve.layers.rotary import VisionRotaryEmbedding, vision_patch_positions
from mmserve.models.qwen2_vl.config import VisionConfig
from mmserve.models.qwen2_vl.vision import Grid, VisionBlock, image_cu_seqlens


class Qwen3PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (stride = kernel, with a bias) as a matmul over flattened patches."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = PatchProjection(vision.dim, vision.in_channels, kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)  # [patches, dim]


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(dim, hidden, group=group)
        self.linear_fc2 = RowParallelLinear(hidden, dim, group=group)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(VisionBlock):
    """Qwen2-VL's block (LayerNorms, attention with 2-D RoPE, an MLP) with Qwen3's MLP names."""

    mlp_class = Qwen3VisionMLP


class Qwen3PatchMerger(nn.Module):
    """Concatenates each merge block's patches and projects them to the language model width.
    The main merger normalises each patch first; the DeepStack mergers normalise the
    concatenation (`after_shuffle`)."""

    def __init__(
        self, vision: VisionConfig, after_shuffle: bool, group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.merged_dim = vision.dim * vision.spatial_merge_size**2
        self.after_shuffle = after_shuffle
        self.norm = nn.LayerNorm(self.merged_dim if after_shuffle else vision.dim, eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear(self.merged_dim, self.merged_dim, group=group)
        self.act = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.merged_dim, vision.out_dim, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_patches, dim] → [num_patches / merge², out_dim]."""
        if self.after_shuffle:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def position_interpolation(
    grid_thw: Sequence[Grid], side: int, spatial_merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (align_corners) into a side×side learned table for every patch, in the
    processor's merge-block order, repeated per frame: (indices [N, 4] int64, weights [N, 4])."""
    positions = vision_patch_positions(grid_thw, spatial_merge_size)  # [N, 2] (row, col)
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grid_thw])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grid_thw])
    taps, weights = [], []
    for axis, size in ((0, heights), (1, widths)):
        # source coordinate of each patch in the table: corners map to corners
        source = positions[:, axis].float() * (side - 1) / torch.clamp(size - 1, min=1)
        low = source.floor()
        offsets = torch.arange(2)
        taps.append((low.long()[:, None] + offsets).clamp(0, side - 1))  # [N, 2]
        weights.append((1 - (source[:, None] - low[:, None] - offsets).abs()).clamp(min=0))
    indices = (taps[0][:, :, None] * side + taps[1][:, None, :]).flatten(1)  # [N, 4]
    return indices, (weights[0][:, :, None] * weights[1][:, None, :]).flatten(1)


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, vision: VisionConfig, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = vision
        # each merged token: the main embedding, then one per DeepStack tap
        self.output_width = vision.out_dim * (1 + len(vision.deepstack_visual_indexes))
        self.patch_embed = Qwen3PatchEmbed(vision)
        self.pos_embed = nn.Embedding(vision.num_position_embeddings, vision.dim)
        self.side = int(vision.num_position_embeddings**0.5)
        self.rotary = VisionRotaryEmbedding(vision.head_dim, vision.rope_theta)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(vision, group) for _ in range(vision.depth))
        self.merger = Qwen3PatchMerger(vision, after_shuffle=False, group=group)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(vision, after_shuffle=True, group=group) for _ in vision.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Grid]) -> torch.Tensor:
        """pixel_values: [num_patches, C·T·P·P] → [num_patches / merge², (1 + D) · out_dim]:
        the merged output, then each DeepStack feature, side by side."""
        vision = self.config
        x = self.patch_embed(pixel_values)  # [N, dim]
        indices, weights = position_interpolation(grid_thw, self.side, vision.spatial_merge_size)
        table = self.pos_embed(indices.to(x.device))  # [N, 4, dim]
        x = x + (table * weights.to(x.device, table.dtype)[:, :, None]).sum(1).to(x.dtype)
        positions = vision_patch_positions(grid_thw, vision.spatial_merge_size).to(x.device)
        cos, sin = self.rotary.cos_sin(positions)
        cu_seqlens = image_cu_seqlens(grid_thw)
        features = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_seqlens)
            if index in vision.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[vision.deepstack_visual_indexes.index(index)]
                features.append(merger(x))
        return torch.cat([self.merger(x), *features], dim=-1)
