"""Qwen2-VL: a ViT with 2-D RoPE and a 2×2 patch merger in front of the Qwen2 language model.

The vision tower turns an image's patches ([num_patches, C·T·P·P], in the processor's
merge-block order) into one embedding per merged 2×2 block; those embeddings replace the
image's placeholder tokens in the language model's input.

Under tensor parallelism the tower is split like the language model (heads and MLP widths over
the ranks) or, with `encoder_data_parallel`, replicated on every rank, each rank encoding its
share of a step's images (`vision_data_parallel`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from mmserve.config import ModelConfig, VisionConfig
from mmserve.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup, get_tp_group
from mmserve.layers.activation import Activation
from mmserve.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.layers.kernel_user import UsesKernels
from mmserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mmserve.layers.packed_weights import PatchProjection
from mmserve.layers.rotary import VisionRotaryEmbedding, vision_patch_positions
from mmserve.layers.vocab_embedding import ParallelLMHead
from mmserve.layers.weights import CheckpointTensor, load_parameter
from mmserve.models.qwen2 import Qwen2Model, load_language_model_weight
from mmserve.models.vision_data_parallel import encode_data_parallel

Grid = tuple[int, int, int]


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride = kernel is a matmul over flattened patches."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = PatchProjection(vision.dim, vision.in_channels, kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)  # [patches, dim]


class VisionAttention(UsesKernels, nn.Module):
    """The checkpoint's qkv is one fused tensor ([q; k; v], each all heads); a rank holds its
    heads' rows of each part."""

    def __init__(self, dim: int, num_heads: int, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.qkv = QKVParallelLinear(dim, self.head_dim, num_heads, num_heads, bias=True, group=group)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.proj = RowParallelLinear(dim, dim, bias=True, group=group)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, H, D]
        q, k = self.kernels.vision_rotary(q, cos, sin), self.kernels.vision_rotary(k, cos, sin)
        out = self.kernels.varlen_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
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


def normalize_checkpoint_name(name: str) -> str:
    """Map transformers-5 layouts (`model.language_model.*`, `model.visual.*`) to the hub's."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return name[len("model.") :]
    return name


class Qwen2VLForConditionalGeneration(nn.Module):
    """Vision tower + Qwen2 language model + LM head; the model runner's one model interface."""

    vision_tower_class: type[nn.Module] = Qwen2VisionTransformer
    language_model_class: type[Qwen2Model] = Qwen2Model

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, encoder_data_parallel: bool = False
    ) -> None:
        super().__init__()
        self.config = config
        self.tp_group = get_tp_group()
        # data parallel: every rank holds the whole tower, built on the group of one
        self.encoder_data_parallel = encoder_data_parallel and self.tp_group.world_size > 1
        self.visual = self.vision_tower_class(
            config.vision, SINGLE_RANK if self.encoder_data_parallel else self.tp_group
        )
        self.model = self.language_model_class(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: Sequence[Grid]) -> list[torch.Tensor]:
        """Run the vision tower once over several images or videos → one [num_tokens_i, width]
        tensor each (width = hidden, or more where the model caches extra features per token).
        Every rank gets every item's embeddings."""
        unit = self.config.vision.spatial_merge_size**2
        if self.encoder_data_parallel:
            merged = encode_data_parallel(self.visual, pixel_values, grid_thw, unit, self.tp_group)
        else:
            merged = self.visual(pixel_values, grid_thw)
        merged = merged.to(getattr(torch, self.config.dtype))  # the tower may compute in float32 (load_model)
        return list(merged.split([t * h * w // unit for t, h, w in grid_thw]))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def merge_multimodal_embeddings(
        self, embeds: torch.Tensor, rows: torch.Tensor, mm_embeds: torch.Tensor
    ) -> torch.Tensor:
        """Put vision embeddings [V, hidden] at their placeholder rows [V] of the step's embeds."""
        embeds[rows] = mm_embeds.to(embeds.dtype)
        return embeds

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [3, T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(inputs_embeds, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] → float32 logits [R, vocab_size], the same on every rank."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Fill every parameter (this rank's shard of it) from the checkpoint's tensors; raises if
        one is missing or unexpected."""
        params = dict(self.named_parameters())
        expected = {n for n in params if not (self.config.tie_word_embeddings and n == "lm_head.weight")}
        filled: set[str] = set()
        for raw_name, weight in weights:
            name = normalize_checkpoint_name(raw_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.startswith("model."):
                filled.add(load_language_model_weight(params, name, weight))
            elif name in params:
                try:
                    load_parameter(params[name], weight)
                except ValueError as e:
                    raise ValueError(f"{raw_name}: {e}") from None
                filled.add(name)
            else:
                raise ValueError(f"unexpected tensor {raw_name!r} in checkpoint")
        missing = expected - filled
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
