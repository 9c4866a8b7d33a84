"""The Qwen3-VL parts of the tiny-checkpoint generator: config.json in transformers 5's nested
layout (`text_config`, `vision_config`), the checkpoint's tensor names (`model.language_model.*`,
`model.visual.*`) and the processor files (16-pixel patches, mean/std 0.5).

Norm scales are drawn at random around 1 with a wide spread (`QK_NORM_STD` for the per-head
q/k norms): at all ones, a tiny random Qwen3's q/k norms make attention nearly uniform and
greedy output collapses to a handful of tokens, so a comparison would pass whatever the
engine did with the image or the positions.
"""

from __future__ import annotations

from mmserve.testing import tokenizer as tok

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MEAN_STD = [0.5, 0.5, 0.5]
QK_NORM_STD = 0.5
NUM_POSITION_EMBEDDINGS = 64  # an 8×8 learned grid, interpolated to every image's patch grid


def head_dim(preset) -> int:
    return preset.hidden_size // preset.num_heads


def deepstack_indexes(preset) -> list[int]:
    """Two DeepStack taps inside the tower (the hub's use three of 27 blocks)."""
    return [preset.vision_depth // 4, preset.vision_depth // 2]


def make_config(preset, init_std: float) -> dict:
    ids = tok.special_token_ids()
    text = {
        "model_type": "qwen3_vl_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": head_dim(preset),
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": init_std,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "num_attention_heads": preset.num_heads,
        "num_hidden_layers": preset.num_layers,
        "num_key_value_heads": preset.num_kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": list(preset.mrope_section),
            "mrope_interleaved": True,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "use_cache": True,
        "vocab_size": preset.vocab_size,
    }
    vision = {
        "model_type": "qwen3_vl_vision",
        "depth": preset.vision_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": preset.vision_dim,
        "intermediate_size": preset.vision_intermediate,
        "num_heads": preset.vision_heads,
        "in_channels": 3,
        "out_hidden_size": preset.hidden_size,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "num_position_embeddings": NUM_POSITION_EMBEDDINGS,
        "deepstack_visual_indexes": deepstack_indexes(preset),
        "initializer_range": init_std,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "dtype": "float32",
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
    }


def weight_shapes(preset) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint with its shape, named as transformers 5 saves Qwen3-VL."""
    h, inter, hd = preset.hidden_size, preset.intermediate_size, head_dim(preset)
    q, kv = preset.num_heads * hd, preset.num_kv_heads * hd
    lm = "model.language_model."
    shapes: dict[str, tuple[int, ...]] = {
        lm + "embed_tokens.weight": (preset.vocab_size, h),
        lm + "norm.weight": (h,),
        "lm_head.weight": (preset.vocab_size, h),
    }
    for i in range(preset.num_layers):
        p = f"{lm}layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    d, vi = preset.vision_dim, preset.vision_intermediate
    v = "model.visual."
    shapes |= {
        v + "patch_embed.proj.weight": (d, 3, TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE),
        v + "patch_embed.proj.bias": (d,),
        v + "pos_embed.weight": (NUM_POSITION_EMBEDDINGS, d),
    }
    for i in range(preset.vision_depth):
        p = f"{v}blocks.{i}."
        shapes |= {
            p + "norm1.weight": (d,),
            p + "norm1.bias": (d,),
            p + "norm2.weight": (d,),
            p + "norm2.bias": (d,),
            p + "attn.qkv.weight": (3 * d, d),
            p + "attn.qkv.bias": (3 * d,),
            p + "attn.proj.weight": (d, d),
            p + "attn.proj.bias": (d,),
            p + "mlp.linear_fc1.weight": (vi, d),
            p + "mlp.linear_fc1.bias": (vi,),
            p + "mlp.linear_fc2.weight": (d, vi),
            p + "mlp.linear_fc2.bias": (d,),
        }
    merged = d * MERGE_SIZE**2
    mergers = [v + "merger."] + [
        f"{v}deepstack_merger_list.{i}." for i in range(len(deepstack_indexes(preset)))
    ]
    for index, p in enumerate(mergers):
        norm_dim = d if index == 0 else merged
        shapes |= {
            p + "norm.weight": (norm_dim,),
            p + "norm.bias": (norm_dim,),
            p + "linear_fc1.weight": (merged, merged),
            p + "linear_fc1.bias": (merged,),
            p + "linear_fc2.weight": (h, merged),
            p + "linear_fc2.bias": (h,),
        }
    return shapes


def norm_scale_std(name: str) -> float:
    """Spread of a norm scale around 1: wide for the per-head q/k norms (see the module doc)."""
    return QK_NORM_STD if ("q_norm" in name or "k_norm" in name) else 0.1


def preprocessor_config(preset) -> dict:
    """preprocessor_config.json: the Qwen2-VL image processor with Qwen3-VL's settings (as the
    hub's Qwen3-VL ships it; transformers maps Qwen3-VL images to that processor)."""
    factor = PATCH_SIZE * MERGE_SIZE
    max_pixels = preset.max_pixels // (28 * 28) * factor * factor  # the same token budget as the others
    min_pixels = preset.min_pixels // (28 * 28) * factor * factor
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": MEAN_STD,
        "image_std": MEAN_STD,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }


def video_preprocessor_config(preset) -> dict:
    """video_preprocessor_config.json: longest_edge bounds the whole clip (frames × pixels)."""
    factor = PATCH_SIZE * MERGE_SIZE
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "do_sample_frames": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": MEAN_STD,
        "image_std": MEAN_STD,
        "size": {
            "shortest_edge": 32 * factor * factor,
            "longest_edge": preset.max_video_frame_tokens * 16 * factor * factor,
        },
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
    }
