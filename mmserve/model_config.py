"""The model's slice of the configuration: what the model code needs to know about a checkpoint,
read from its Hugging Face folder (config.json and the side files of `model_folder`), plus the
dtype it runs in.

Split from `mmserve.config` (which re-exports `ModelConfig` and `VisionConfig`) so that module
holds the engine's slices only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mmserve.model_folder import eos_ids, max_image_tokens, max_video_tokens

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a model runs in, by torch's names (`getattr(torch, name)` is the torch dtype)."""
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(name: str, default: str) -> str:
    """'auto' → `default` (the checkpoint's); otherwise a known dtype name or alias, as one of
    DTYPES. (Names, not torch dtypes: the API server and the scheduler never import torch.)"""
    name = str(name).removeprefix("torch.")
    if name == "auto":
        return default
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(sorted(_DTYPE_ALIASES))}")
    return _DTYPE_ALIASES[name]


# CPU flags (/proc/cpuinfo) with which torch computes a half-precision dtype natively.
_FAST_CPU_FLAGS = {"bfloat16": {"avx512_bf16", "amx_bf16"}, "float16": {"avx512_fp16", "amx_fp16"}}


def cpu_computes_natively(dtype: str) -> bool:
    """float32 always; bfloat16 / float16 only on CPUs with matching instructions (AVX512-BF16,
    AMX...). Elsewhere `--dtype auto` keeps float32: the token-exact path, and on an AVX2-only
    CPU the faster one for image-heavy serving (BENCHMARKS.md, "§5 again")."""
    if dtype not in _FAST_CPU_FLAGS:
        return True
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    lines = [line for line in text.splitlines() if line.startswith("flags")]
    flags = set(lines[0].split(":", 1)[1].split()) if lines else set()
    return bool(_FAST_CPU_FLAGS[dtype] & flags)


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen2-VL-family model."""

    family: str  # "qwen2_vl" | "qwen2_5_vl" | "qwen3_vl"
    depth: int
    dim: int  # width of the vision transformer (Qwen2-VL `embed_dim`, Qwen2.5-VL `hidden_size`)
    num_heads: int
    mlp_dim: int
    out_dim: int  # width of the merged tokens = the language model's hidden size
    hidden_act: str
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    in_channels: int = 3
    rope_theta: float = 10000.0
    window_size: int = 0  # Qwen2.5-VL window attention (pixels); 0 = none
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: float = 0.0  # Qwen2.5-VL: temporal position units per second of video
    num_position_embeddings: int = 0  # Qwen3-VL: learned position table (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose features feed the LM

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs to know about a checkpoint, plus the chosen dtype and length."""

    path: Path
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    vision: VisionConfig
    dtype: str  # one of DTYPES
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_image_tokens: int = 0  # placeholder tokens of the largest image the processor can produce
    video_token_id: int = -1
    max_video_tokens: int = 0  # placeholder tokens of the largest video item (Qwen3-VL: one frame pair)
    explicit_head_dim: int = 0  # Qwen3 sets head_dim in its config; 0 = hidden_size / num_heads
    qkv_bias: bool = True  # Qwen2 has q/k/v biases; Qwen3 has none (and q/k norms instead)
    mrope_interleaved: bool = False  # Qwen3-VL interleaves the t/h/w rotary channels

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: str = "auto", max_model_len: int | None = None
    ) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} is not a model folder: no config.json")
        raw = json.loads(config_file.read_text())
        # transformers 5 saves text fields under text_config; the hub releases keep them flat.
        text = {**raw, **raw.get("text_config", {})}
        family = raw.get("model_type", "")
        if family not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
            raise ValueError(f"unsupported model_type {family!r} in {config_file}")
        rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
        checkpoint_dtype = parse_dtype(text.get("torch_dtype") or text.get("dtype") or "float32", "float32")
        limit = int(text.get("max_position_embeddings", 32768))
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}"
            )
        return cls(
            path=path,
            architecture=(raw.get("architectures") or ["?"])[0],
            family=family,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
            mrope_section=tuple(rope.get("mrope_section", (16, 24, 24))),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            image_token_id=int(raw["image_token_id"]),
            vision_start_token_id=int(raw["vision_start_token_id"]),
            vision_end_token_id=int(raw["vision_end_token_id"]),
            vision=_vision_config(family, raw["vision_config"], int(text["hidden_size"])),
            dtype=parse_dtype(dtype, checkpoint_dtype),
            max_model_len=max_model_len or limit,
            eos_token_ids=eos_ids(path, text),
            max_image_tokens=max_image_tokens(path, raw["vision_config"]),
            video_token_id=int(raw.get("video_token_id", -1)),
            max_video_tokens=max_video_tokens(path, family, raw["vision_config"]),
            explicit_head_dim=int(text.get("head_dim") or 0) if family == "qwen3_vl" else 0,
            qkv_bias=bool(text.get("attention_bias", family != "qwen3_vl")),
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        )


def _vision_config(family: str, raw: dict, text_hidden_size: int) -> VisionConfig:
    common = dict(
        family=family,
        depth=int(raw["depth"]),
        num_heads=int(raw["num_heads"]),
        patch_size=int(raw.get("patch_size", raw.get("spatial_patch_size", 14))),
        spatial_merge_size=int(raw.get("spatial_merge_size", 2)),
        temporal_patch_size=int(raw.get("temporal_patch_size", 2)),
        in_channels=int(raw.get("in_chans", raw.get("in_channels", 3))),
    )
    if family == "qwen3_vl":
        return VisionConfig(
            dim=int(raw["hidden_size"]),
            mlp_dim=int(raw["intermediate_size"]),
            out_dim=int(raw.get("out_hidden_size", text_hidden_size)),
            hidden_act=raw.get("hidden_act", "gelu_pytorch_tanh"),
            num_position_embeddings=int(raw.get("num_position_embeddings", 2304)),
            deepstack_visual_indexes=tuple(raw.get("deepstack_visual_indexes", (8, 16, 24))),
            **common,
        )
    if family == "qwen2_vl":
        dim = int(raw["embed_dim"])
        return VisionConfig(
            dim=dim,
            mlp_dim=int(dim * raw.get("mlp_ratio", 4)),
            out_dim=int(raw.get("hidden_size", text_hidden_size)),
            hidden_act=raw.get("hidden_act", "quick_gelu"),
            **common,
        )
    return VisionConfig(
        dim=int(raw["hidden_size"]),
        mlp_dim=int(raw["intermediate_size"]),
        out_dim=int(raw.get("out_hidden_size", text_hidden_size)),
        hidden_act=raw.get("hidden_act", "silu"),
        window_size=int(raw.get("window_size", 112)),
        fullatt_block_indexes=tuple(raw.get("fullatt_block_indexes", (7, 15, 23, 31))),
        tokens_per_second=float(raw.get("tokens_per_second", 2)),
        **common,
    )
