"""Which family serves a model folder: Hugging Face `architectures` → `ModelFamily`, and the
folder's configuration read through it. Imports no torch (the API server reads configs too).

Adding a family is one line here: its `FAMILY` in `FAMILIES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmserve.model_config import ModelConfig, parse_dtype
from mmserve.model_folder import eos_ids, read_config, text_fields
from mmserve.models.family import FolderConfig, ModelFamily
from mmserve.models.qwen2_5_vl.family import FAMILY as QWEN2_5_VL
from mmserve.models.qwen2_vl.family import FAMILY as QWEN2_VL
from mmserve.models.qwen3_vl.family import FAMILY as QWEN3_VL

FAMILIES: tuple[ModelFamily, ...] = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)


def served_architectures() -> list[str]:
    return sorted(a for family in FAMILIES for a in family.architectures)


def family_for(architecture: str, model_type: str = "") -> ModelFamily:
    """The family serving `architecture` (or, for a folder that names none, its model_type);
    ValueError naming the architectures that are served otherwise."""
    for family in FAMILIES:
        if architecture in family.architectures or (not architecture and model_type == family.name):
            return family
    raise ValueError(
        f"architecture {architecture or model_type!r} is not served by mmserve; "
        f"served: {', '.join(served_architectures())}"
    )


def family_named(name: str) -> ModelFamily:
    """The family whose `name` a ModelConfig carries."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"no model family {name!r}; families: {', '.join(f.name for f in FAMILIES)}")


def load_model_config(
    path: str | Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    processor_kwargs: dict[str, Any] | None = None,
) -> ModelConfig:
    """The folder's ModelConfig, built by the family that serves its architecture.

    dtype "auto" is the checkpoint's; `max_model_len` (None: the model's
    max_position_embeddings) may not exceed what the model was trained for;
    `processor_kwargs` (--mm-processor-kwargs) may set only what the family takes."""
    path = Path(path)
    raw = read_config(path)
    text = text_fields(raw)
    architecture = (raw.get("architectures") or [""])[0]
    family = family_for(architecture, raw.get("model_type", ""))
    processor_kwargs = dict(processor_kwargs or {})
    unknown = set(processor_kwargs) - set(family.processor_kwargs)
    if unknown:
        takes = ", ".join(family.processor_kwargs) or "none"
        raise ValueError(f"mm_processor_kwargs sets {sorted(unknown)}; {family.name} folders take {takes}")
    limit = int(text.get("max_position_embeddings", 32768))
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    checkpoint_dtype = parse_dtype(text.get("torch_dtype") or text.get("dtype") or "float32", "float32")
    folder = FolderConfig(
        path=path,
        raw=raw,
        architecture=architecture or family.architectures[0],
        dtype=parse_dtype(dtype, checkpoint_dtype),
        max_model_len=max_model_len or limit,
        eos_token_ids=eos_ids(path, text),
        processor_kwargs=processor_kwargs,
    )
    return family.model_config(folder)
