"""Architecture name (config.json `architectures[0]`) → model class."""

from __future__ import annotations

from torch import nn

from mmserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from mmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from mmserve.models.qwen3_vl import Qwen3VLForConditionalGeneration

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
}
_BY_FAMILY = {
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}


def model_class(architecture: str, family: str) -> type[nn.Module]:
    if architecture in MODEL_CLASSES:
        return MODEL_CLASSES[architecture]
    if family in _BY_FAMILY:
        return _BY_FAMILY[family]
    raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_CLASSES)}")
