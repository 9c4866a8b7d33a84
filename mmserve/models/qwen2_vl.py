"""Qwen2-VL: a ViT with 2-D RoPE and a 2×2 patch merger in front of the Qwen2 language model.

The vision tower turns an image's patches ([num_patches, C·T·P·P], in the processor's
merge-block order) into one embedding per merged 2×2 block; those embeddings replace the
image's placeholder tokens in the language model's input.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.config import ModelConfig, VisionConfig
from mmserve.layers.activation import get_activation
from mmserve.layers.attention import AttentionBackend, AttentionMetadata
from mmserve.layers.kernel_user import UsesKernels
from mmserve.layers.rotary import VisionRotaryEmbedding, apply_vision_rotary, vision_patch_positions
from mmserve.models.qwen2 import Qwen2Model, load_language_model_weight

Grid = tuple[int, int, int]


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride = kernel is a matmul over flattened patches."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(vision.dim, vision.in_channels, *kernel))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.flatten(1)  # [dim, C·T·P·P]
        return F.linear(pixel_values.to(weight.dtype), weight)


class VisionAttention(UsesKernels, nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, H, D]
        q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        out = self.kernels.varlen_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    mlp_class: type[nn.Module] = VisionMLP

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(vision.dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(vision.dim, eps=1e-6)
        self.attn = VisionAttention(vision.dim, vision.num_heads)
        self.mlp = self.mlp_class(vision.dim, vision.mlp_dim, vision.hidden_act)

    def forward(self, x, cos, sin, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each merge block's patches and projects them to the language model width."""

    def __init__(self, vision: VisionConfig, norm: nn.Module) -> None:
        super().__init__()
        self.merged_dim = vision.dim * vision.spatial_merge_size**2
        self.ln_q = norm
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, vision.out_dim)
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
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.config = vision
        self.patch_embed = PatchEmbed(vision)
        self.rotary = VisionRotaryEmbedding(vision.head_dim, vision.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.depth))
        self.merger = PatchMerger(vision, nn.LayerNorm(vision.dim, eps=1e-6))

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

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.visual = self.vision_tower_class(config.vision)
        self.model = Qwen2Model(config, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: Sequence[Grid]) -> list[torch.Tensor]:
        """Run the vision tower once over several images or videos → one [num_tokens_i, width]
        tensor each (width = hidden, or more where the model caches extra features per token)."""
        merged = self.visual(pixel_values, grid_thw)
        unit = self.config.vision.spatial_merge_size**2
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
        """hidden: [R, hidden] → float32 logits [R, vocab_size]."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from checkpoint tensors; raises if one is missing or unexpected."""
        params = dict(self.named_parameters())
        expected = {n for n in params if not (self.config.tie_word_embeddings and n == "lm_head.weight")}
        filled: set[str] = set()
        for raw_name, weight in weights:
            name = normalize_checkpoint_name(raw_name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name.startswith("model."):
                filled.add(load_language_model_weight(params, self.config, name, weight).split("#")[0])
            elif name in params:
                if params[name].shape != weight.shape:
                    raise ValueError(
                        f"{raw_name}: shape {tuple(weight.shape)} != {tuple(params[name].shape)}"
                    )
                params[name].data.copy_(weight)
                filled.add(name)
            else:
                raise ValueError(f"unexpected tensor {raw_name!r} in checkpoint")
        missing = expected - filled
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
