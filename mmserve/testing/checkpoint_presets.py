"""The shapes the random-weight test checkpoints come in (`checkpoints.checkpoint(family,
preset_name)`): each preset's language model and vision tower sizes, by name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mrope_section: tuple[int, int, int]
    vision_dim: int  # Qwen2-VL `embed_dim`, Qwen2.5-VL `hidden_size`
    vision_depth: int
    vision_heads: int
    vision_intermediate: int  # Qwen2.5-VL MLP width (Qwen2-VL uses mlp_ratio 4)
    fullatt_block_indexes: tuple[int, ...]  # Qwen2.5-VL only
    max_pixels: int
    min_pixels: int = 56 * 56
    vocab_size: int = 12032  # > len(tokenizer), as in Qwen2 (logits are sized from this)
    max_position_embeddings: int = 4096
    max_video_frame_tokens: int = 64  # a video frame's token cap (Qwen3-VL: × 16 frames, per clip)


PRESETS: dict[str, Preset] = {
    # A few million parameters; every image is at most 64 merged tokens.
    "tiny": Preset(
        hidden_size=128,
        intermediate_size=352,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        mrope_section=(4, 6, 6),
        vision_dim=64,
        vision_depth=4,
        vision_heads=4,
        vision_intermediate=128,
        fullatt_block_indexes=(1, 3),
        max_pixels=256 * 28 * 28,
    ),
    # Shapes that split over 3 ranks (tensor-parallel tests): 6 query heads, one KV head (each
    # rank replicates it), widths divisible by 3; the vocabulary is not (its padding is tested).
    "tp3": Preset(
        hidden_size=192,
        intermediate_size=384,
        num_layers=2,
        num_heads=6,
        num_kv_heads=1,
        mrope_section=(4, 6, 6),
        vision_dim=96,
        vision_depth=2,
        vision_heads=6,
        vision_intermediate=192,
        fullatt_block_indexes=(1,),
        max_pixels=256 * 28 * 28,
    ),
    # About 170M parameters, for benchmarks.
    "mid": Preset(
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        mrope_section=(8, 12, 12),
        vision_dim=640,
        vision_depth=12,
        vision_heads=10,
        vision_intermediate=1728,
        fullatt_block_indexes=(3, 7, 11),
        max_pixels=1024 * 28 * 28,
    ),
    # Qwen2-VL-2B's language model shape (hidden 1536, 28 layers, 12 / 2 heads, MLP 8960, its
    # vocabulary size) with the mid vision tower, for GPU timings (benchmarks/gpu_check.py);
    # about 1.8B parameters in all (untied LM head).
    "2b": Preset(
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        mrope_section=(16, 24, 24),
        vision_dim=640,
        vision_depth=12,
        vision_heads=10,
        vision_intermediate=1728,
        fullatt_block_indexes=(3, 7, 11),
        max_pixels=1024 * 28 * 28,
        vocab_size=151936,
    ),
}
