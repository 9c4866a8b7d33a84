"""Tiny (and mid-size) Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints with random weights, made offline.

Each folder has the Hugging Face hub's layout: config.json (for Qwen2-VL and Qwen2.5-VL text
fields flat at the top level, `vision_config` nested, as those releases ship it; for Qwen3-VL
transformers 5's nested `text_config` / `vision_config`, see `qwen3_checkpoint`),
model.safetensors with the checkpoint's tensor names, the committed tokenizer with the family's
chat template, preprocessor_config.json, video_preprocessor_config.json and
generation_config.json. transformers and mmserve load the same folder, which is what makes
token-for-token comparisons possible without downloading anything.

Weights are drawn from a fixed seed with std 0.1: the usual 0.02 gives a model whose greedy
output barely depends on its input, so it would not catch a wrong image or position.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from mmserve import envs
from mmserve.testing import qwen3_checkpoint as qwen3
from mmserve.testing import tokenizer as tok
from mmserve.testing.checkpoint_presets import PRESETS, Preset

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
GENERATOR_VERSION = 2  # bump when the weights or files written here change


PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
INIT_STD = 0.1


def vision_config(family: str, preset: Preset) -> tuple[str, dict]:
    """(architecture, vision_config) of a Qwen2-VL or Qwen2.5-VL folder."""
    if family == "qwen2_vl":
        return "Qwen2VLForConditionalGeneration", {
            "depth": preset.vision_depth,
            "embed_dim": preset.vision_dim,
            "mlp_ratio": 4,
            "num_heads": preset.vision_heads,
            "in_chans": 3,
            "hidden_size": preset.hidden_size,
            "hidden_act": "quick_gelu",
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "spatial_patch_size": PATCH_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        }
    if family == "qwen2_5_vl":
        return "Qwen2_5_VLForConditionalGeneration", {
            "depth": preset.vision_depth,
            "hidden_act": "silu",
            "hidden_size": preset.vision_dim,
            "intermediate_size": preset.vision_intermediate,
            "num_heads": preset.vision_heads,
            "in_chans": 3,
            "out_hidden_size": preset.hidden_size,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "spatial_patch_size": PATCH_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
            "tokens_per_second": 2,
            "window_size": 112,
            "fullatt_block_indexes": list(preset.fullatt_block_indexes),
        }
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def make_config(family: str, preset: Preset) -> dict:
    """config.json: the hub's flat layout (Qwen2-VL, Qwen2.5-VL), transformers 5's (Qwen3-VL)."""
    if family == "qwen3_vl":
        return qwen3.make_config(preset, INIT_STD)
    ids = tok.special_token_ids()
    head_dim = preset.hidden_size // preset.num_heads
    assert 2 * sum(preset.mrope_section) == head_dim, "mrope_section must cover head_dim / 2"
    architecture, vision = vision_config(family, preset)
    return {
        "architectures": [architecture],
        "model_type": family,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "max_window_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_hidden_layers": preset.num_layers,
        "num_key_value_heads": preset.num_kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(preset.mrope_section)},
        "sliding_window": preset.max_position_embeddings,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": preset.vocab_size,
        "vision_config": vision,
    }


def weight_shapes(family: str, preset: Preset) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, named as in the hub's checkpoints."""
    if family == "qwen3_vl":
        return qwen3.weight_shapes(preset)
    return language_model_shapes(preset) | vision_tower_shapes(family, preset)


def language_model_shapes(preset: Preset) -> dict[str, tuple[int, ...]]:
    """The Qwen2 language model's tensors (`model.*`, `lm_head.*`)."""
    h, inter = preset.hidden_size, preset.intermediate_size
    head_dim = h // preset.num_heads
    kv = preset.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (preset.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (preset.vocab_size, h),
    }
    for i in range(preset.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return shapes


def vision_tower_shapes(family: str, preset: Preset) -> dict[str, tuple[int, ...]]:
    """The Qwen2-VL / Qwen2.5-VL vision tower's tensors (`visual.*`)."""
    h = preset.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    d = preset.vision_dim
    merged = d * MERGE_SIZE**2
    shapes["visual.patch_embed.proj.weight"] = (d, 3, TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE)
    for i in range(preset.vision_depth):
        p = f"visual.blocks.{i}."
        shapes |= {
            p + "attn.qkv.weight": (3 * d, d),
            p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d),
            p + "attn.proj.bias": (d,),
            p + "norm1.weight": (d,),
            p + "norm2.weight": (d,),
        }
        if family == "qwen2_vl":
            shapes |= {
                p + "norm1.bias": (d,),
                p + "norm2.bias": (d,),
                p + "mlp.fc1.weight": (4 * d, d),
                p + "mlp.fc1.bias": (4 * d,),
                p + "mlp.fc2.weight": (d, 4 * d),
                p + "mlp.fc2.bias": (d,),
            }
        else:
            vi = preset.vision_intermediate
            shapes |= {
                p + "mlp.gate_proj.weight": (vi, d),
                p + "mlp.gate_proj.bias": (vi,),
                p + "mlp.up_proj.weight": (vi, d),
                p + "mlp.up_proj.bias": (vi,),
                p + "mlp.down_proj.weight": (d, vi),
                p + "mlp.down_proj.bias": (d,),
            }
    shapes |= {
        "visual.merger.ln_q.weight": (d,),
        "visual.merger.mlp.0.weight": (merged, merged),
        "visual.merger.mlp.0.bias": (merged,),
        "visual.merger.mlp.2.weight": (h, merged),
        "visual.merger.mlp.2.bias": (h,),
    }
    if family == "qwen2_vl":
        shapes["visual.merger.ln_q.bias"] = (d,)
    return shapes


def random_weights(family: str, preset: Preset, seed: int) -> dict[str, torch.Tensor]:
    """Norm scales near 1, everything else N(0, INIT_STD), drawn in a fixed order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(weight_shapes(family, preset).items()):
        values = torch.randn(shape, generator=gen, dtype=torch.float32)
        is_norm_scale = ("norm" in name or "ln_q" in name) and name.endswith(".weight")
        weights[name] = 1.0 + qwen3.norm_scale_std(name) * values if is_norm_scale else INIT_STD * values
    return weights


def preprocessor_config(family: str, preset: Preset) -> dict:
    if family == "qwen3_vl":
        return qwen3.preprocessor_config(preset)
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "min_pixels": preset.min_pixels,
        "max_pixels": preset.max_pixels,
        "size": {"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }


def video_preprocessor_config(family: str, preset: Preset) -> dict:
    """The family's video processor: Qwen2-VL's bounds each frame by max_pixels."""
    if family == "qwen3_vl":
        return qwen3.video_preprocessor_config(preset)
    frame_pixels = preset.max_video_frame_tokens * 28 * 28
    return {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "min_pixels": 16 * 28 * 28,
        "max_pixels": frame_pixels,
        "size": {"shortest_edge": 16 * 28 * 28, "longest_edge": frame_pixels},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }


def generation_config() -> dict:
    ids = tok.special_token_ids()
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
    }


def write_checkpoint(out_dir: Path, family: str, preset_name: str = "tiny", seed: int = 0) -> Path:
    """Write a complete model folder to `out_dir` (created); returns it."""
    preset = PRESETS[preset_name]
    out_dir.mkdir(parents=True, exist_ok=True)
    config = make_config(family, preset)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_weights(family, preset, seed), str(out_dir / "model.safetensors"), {"format": "pt"})
    shutil.copyfile(tok.TOKENIZER_JSON, out_dir / "tokenizer.json")
    tok_config = tok.tokenizer_config(preset.max_position_embeddings, family)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    preprocessor = preprocessor_config(family, preset)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    video = video_preprocessor_config(family, preset)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(), indent=2))
    return out_dir


def checkpoint(family: str, preset_name: str = "tiny", seed: int = 0) -> Path:
    """A cached model folder for (family, preset, seed), generated on first use.

    The cache key covers the generator version, the preset and the tokenizer bytes, so a change
    to any of them makes a new folder instead of reusing a stale one. Written atomically
    (temp dir + rename) so concurrent test processes never see a half-written folder.
    """
    key_src = (
        json.dumps(
            [GENERATOR_VERSION, family, preset_name, seed, asdict(PRESETS[preset_name])], sort_keys=True
        ).encode()
        + tok.TOKENIZER_JSON.read_bytes()
    )
    key = hashlib.sha256(key_src).hexdigest()[:16]
    final = envs.cache_dir() / "checkpoints" / f"{family}-{preset_name}-s{seed}-{key}"
    if (final / "model.safetensors").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
    write_checkpoint(tmp, family, preset_name, seed)
    try:
        tmp.rename(final)
    except OSError:  # another process won the race; its folder is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def count_parameters(family: str, preset_name: str) -> int:
    shapes = weight_shapes(family, PRESETS[preset_name]).values()
    return sum(int(torch.tensor(s).prod()) for s in shapes)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write a random-weight Qwen2-VL-family model folder.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_vl")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_checkpoint(args.out_dir, args.family, args.preset, args.seed)
    print(f"wrote {args.out_dir} ({count_parameters(args.family, args.preset) / 1e6:.1f}M parameters)")
