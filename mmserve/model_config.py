"""The model's slice of the configuration: what the generic engine needs to know about a
checkpoint (each family adds its own fields in a subclass, mmserve/models/<family>/), plus the
dtype it runs in and the dtype rules.

Split from `mmserve.config` (which re-exports `ModelConfig`) so that module holds the engine's
slices only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmserve import host_cpu

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
    return bool(_FAST_CPU_FLAGS[dtype] & set(host_cpu.flags().split()))


@dataclass(frozen=True)
class FullAttentionSpec:
    """What a full-attention decoder layer keeps per request: the keys and values of every
    token, in paged blocks. (The per-layer declaration the KV cache is sized and allocated from;
    sliding-window and linear-attention layers are other kinds, not built yet.)"""

    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What the generic engine knows about a checkpoint, whatever its family: sizes, the dtype
    and length it runs at, and what each decoder layer keeps per request. A family's own fields
    (its vision tower, rotary sections, special tokens...) are on its subclass, defined in its
    folder under mmserve/models/ and built by its `ModelFamily.model_config`
    (`mmserve.models.registry.load_model_config` reads a folder)."""

    path: Path
    architecture: str  # config.json `architectures[0]`
    family: str  # the name of the family that serves it (mmserve.models.registry)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # attention (query) heads
    num_kv_heads: int
    head_dim: int
    dtype: str  # one of DTYPES
    max_model_len: int
    layers: tuple[FullAttentionSpec, ...]  # one per decoder layer
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    max_image_tokens: int = 0  # placeholder tokens of the largest image the processor can produce
    max_video_tokens: int = 0  # placeholder tokens of the largest video item
    # Position ids per token: 1 for RoPE over the token index, 3 for M-RoPE's (t, h, w).
    position_rows: int = 1

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} decoder layers")

    def split_widths(self, split_encoder: bool) -> dict[str, int]:
        """Widths that tensor parallelism divides over the ranks, by the config's name for them
        (`split_encoder`: the vision tower is split too, not replicated)."""
        return {"num_attention_heads": self.num_heads}


def full_attention_layers(num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[FullAttentionSpec, ...]:
    """Every decoder layer full attention, with the same KV heads."""
    return (FullAttentionSpec(num_kv_heads, head_dim),) * num_layers
