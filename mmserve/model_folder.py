"""What a Hugging Face model folder says that every family's config needs: config.json (with
transformers 5's nested `text_config` folded in) and the EOS ids of generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path


def read_config(path: Path) -> dict:
    """config.json of the folder at `path` (FileNotFoundError where there is none)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a model folder: no config.json")
    return json.loads(config_file.read_text())


def text_fields(raw: dict) -> dict:
    """The language model's fields: transformers 5 saves them under `text_config`, the hub's
    releases of older families keep them at the top level; the nested ones win."""
    return {**raw, **raw.get("text_config", {})}


def eos_ids(path: Path, text: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several), else config.json."""
    generation_file = path / "generation_config.json"
    eos = json.loads(generation_file.read_text()).get("eos_token_id") if generation_file.is_file() else None
    if eos is None:
        eos = text.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
