"""Qwen2-VL: the vision tower (vision.py) in front of the Qwen2 language model
(language_model.py), and the checkpoint's tensor names.

The tower's embeddings replace the image's placeholder tokens in the language model's input.
Under tensor parallelism the tower is split like the language model or, with
`encoder_data_parallel`, replicated on every rank, each rank encoding its share of a step's
images (`vision_data_parallel`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from mmserve.distributed.parallel_state import SINGLE_RANK, get_tp_group
from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.vocab_embedding import ParallelLMHead
from mmserve.layers.weights import CheckpointTensor, load_parameter
from mmserve.models.qwen2_vl.config import QwenVLConfig
from mmserve.models.qwen2_vl.language_model import Qwen2Model, load_language_model_weight
from mmserve.models.qwen2_vl.vision import Grid, Qwen2VisionTransformer, one_width
from mmserve.models.vision_data_parallel import encode_data_parallel


def normalize_checkpoint_name(name: str) -> str:
    """Map transformers-5 layouts (`model.language_model.*`, `model.visual.*`) to the hub's."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("model.visual."):
        return name[len("model.") :]
    return name


class Qwen2VLForConditionalGeneration(nn.Module):
    """Vision tower + Qwen2 language model + LM head (`mmserve.models.interface.MultiModalModel`)."""

    vision_tower_class: type[nn.Module] = Qwen2VisionTransformer
    language_model_class: type[Qwen2Model] = Qwen2Model

    def __init__(self, config: QwenVLConfig, encoder_data_parallel: bool = False) -> None:
        super().__init__()
        self.config = config
        self.tp_group = get_tp_group()
        # data parallel: every rank holds the whole tower, built on the group of one
        self.encoder_data_parallel = encoder_data_parallel and self.tp_group.world_size > 1
        self.visual = self.vision_tower_class(
            config.vision, SINGLE_RANK if self.encoder_data_parallel else self.tp_group
        )
        self.model = self.language_model_class(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def vision_tower(self) -> nn.Module:
        return self.visual

    @property
    def language_model(self) -> nn.Module:
        return self.model

    def encode_images(self, pixel_values: list[torch.Tensor], grid_thw: Sequence[Grid]) -> list[torch.Tensor]:
        """Run the vision tower once over several images or videos → one [num_tokens_i, width]
        tensor each (width = hidden, or more where the model caches extra features per token).
        `pixel_values`: tensors whose rows, concatenated, are the items' patches in order (one per
        item as the runner passes them), each [rows, C·P·P] (a still image's frame once) or
        [rows, C·T·P·P]. Every rank gets every item's embeddings."""
        unit = self.config.vision.spatial_merge_size**2
        pixel_values = (
            pixel_values[0]
            if len(pixel_values) == 1
            else torch.cat(one_width(pixel_values, self.config.vision.in_channels))
        )
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
