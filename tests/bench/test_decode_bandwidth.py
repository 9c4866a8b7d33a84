"""The decode benchmark's arithmetic floor counts the FLOPs the checkpoint's weights imply."""

from __future__ import annotations

from safetensors import safe_open

from benchmarks.decode_bandwidth import step_flops
from mmserve.models.registry import load_model_config
from mmserve.testing.checkpoints import checkpoint


def test_step_flops_match_the_checkpoints_weights() -> None:
    """2 FLOPs per language-model matrix element (every layer's linears and the LM head, not the
    embedding or the vision tower) and batch row, plus 4 per query-head dimension and key."""
    path = checkpoint("qwen2_vl", "tiny")
    config = load_model_config(path)
    matrices = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as tensors:
            names = tensors.keys()
            for name in names:
                shape = tensors.get_slice(name).get_shape()
                language = name.startswith("model.layers.") or name == "lm_head.weight"
                if language and name.endswith(".weight") and len(shape) == 2:
                    matrices += shape[0] * shape[1]
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * 100
    assert step_flops(config, 1, 100) == 2 * matrices + attention
    assert step_flops(config, 8, 100) == 8 * (2 * matrices + attention)
