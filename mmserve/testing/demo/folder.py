"""The demo model's folder: hub layout, as `checkpoints.write_checkpoint` writes it.

The architecture is Qwen2-VL at about 12M parameters. The preprocessor caps every picture at 64
image tokens (224×224 pixels' worth) and lifts tiny ones to 16, so any upload costs the model a
few dozen tokens and lands in the range of sizes it was trained on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from mmserve.testing import checkpoints
from mmserve.testing import tokenizer as tok
from mmserve.testing.checkpoint_presets import Preset

FAMILY = "qwen2_vl"
INIT_STD = 0.05  # 0.02 trains a model that ignores the picture and answers from priors
PRESET = Preset(
    hidden_size=256,
    intermediate_size=1024,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    mrope_section=(8, 12, 12),
    vision_dim=128,
    vision_depth=4,
    vision_heads=4,
    vision_intermediate=512,  # unused by Qwen2-VL (mlp_ratio 4)
    fullatt_block_indexes=(),
    max_pixels=64 * 28 * 28,
    min_pixels=16 * 28 * 28,
    max_position_embeddings=2048,
)
REPO_DIR = Path(__file__).resolve().parents[3]
DEMO_MODEL_DIR = REPO_DIR / "assets" / "demo-model"


def config(preset: Preset = PRESET) -> dict:
    cfg = checkpoints.make_config(FAMILY, preset)
    cfg["initializer_range"] = INIT_STD
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def write_files(out_dir: Path, preset: Preset = PRESET) -> Path:
    """Everything but the weights: config, tokenizer, chat template, preprocessor, generation."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config(preset), indent=2) + "\n")
    shutil.copyfile(tok.TOKENIZER_JSON, out_dir / "tokenizer.json")
    tok_config = tok.tokenizer_config(PRESET.max_position_embeddings)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    preprocessor = checkpoints.preprocessor_config(FAMILY, PRESET)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    generation = checkpoints.generation_config()
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


def hub_state_dict(
    model: torch.nn.Module, preset: Preset = PRESET, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """transformers 5 names (`model.language_model.*`, `model.visual.*`) → the hub's names
    (`model.*`, `visual.*`), checked against `checkpoints.weight_shapes`."""
    renamed = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.visual."):
            name = "visual." + name.removeprefix("model.visual.")
        renamed[name] = tensor.detach().to(dtype).contiguous()
    expected = checkpoints.weight_shapes(FAMILY, preset)
    if set(renamed) != set(expected):
        raise RuntimeError(
            f"tensor names differ from the hub layout: missing {sorted(set(expected) - set(renamed))}, "
            f"unexpected {sorted(set(renamed) - set(expected))}"
        )
    for name, shape in expected.items():
        if tuple(renamed[name].shape) != shape:
            raise RuntimeError(f"{name}: shape {tuple(renamed[name].shape)}, hub layout says {shape}")
    return renamed


def write_weights(model: torch.nn.Module, out_dir: Path, preset: Preset = PRESET) -> None:
    save_file(hub_state_dict(model, preset), str(out_dir / "model.safetensors"), {"format": "pt"})


def num_parameters() -> int:
    shapes = checkpoints.weight_shapes(FAMILY, PRESET).values()
    return sum(int(torch.tensor(shape).prod()) for shape in shapes)
