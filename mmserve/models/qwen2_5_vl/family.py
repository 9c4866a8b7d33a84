"""Qwen2.5-VL as a model family: Qwen2-VL's (`qwen2_vl/family.py`) with its own vision config
and modules. Imports no torch."""

from __future__ import annotations

from typing import Any

from mmserve.models.qwen2_vl.config import VisionConfig
from mmserve.models.qwen2_vl.family import Qwen2VLFamily, common_vision_fields


class Qwen2_5VLFamily(Qwen2VLFamily):
    name = "qwen2_5_vl"
    architectures = ("Qwen2_5_VLForConditionalGeneration",)

    def vision_config(self, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        return VisionConfig(
            dim=int(raw["hidden_size"]),
            mlp_dim=int(raw["intermediate_size"]),
            out_dim=int(raw.get("out_hidden_size", text_hidden_size)),
            hidden_act=raw.get("hidden_act", "silu"),
            window_size=int(raw.get("window_size", 112)),
            fullatt_block_indexes=tuple(raw.get("fullatt_block_indexes", (7, 15, 23, 31))),
            tokens_per_second=float(raw.get("tokens_per_second", 2)),
            **common_vision_fields(raw),
        )

    def model_class(self) -> type:
        from mmserve.models.qwen2_5_vl.model import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration


FAMILY = Qwen2_5VLFamily()
