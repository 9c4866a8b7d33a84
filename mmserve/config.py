"""Frozen configuration slices. Each component is handed only the slice it needs.

`ModelConfig` is read from a Hugging Face model folder; the others are built by
`EngineArgs.create_engine_config` from what a user sets (the offline `LLM(...)` keyword
arguments or the `mmserve serve` flags). `ServerConfig` is the HTTP server's own. Derived values
are properties, never written back. Every default is written once, on its slice's field:
`EngineArgs` and the CLI read them from there (`field_default`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmserve.model_folder import eos_ids, max_image_tokens, max_video_tokens

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype, default: torch.dtype) -> torch.dtype:
    """'auto' → `default` (the checkpoint's dtype); otherwise a known dtype name."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return default
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


# CPU flags (/proc/cpuinfo) with which torch computes a half-precision dtype natively.
_FAST_CPU_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}


def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """float32 always; bfloat16 / float16 only on CPUs with matching instructions (AVX512-BF16,
    AMX...): elsewhere torch converts every operand, and a bf16 linear layer runs several times
    slower than a float32 one (4-20x on an AVX2-only EPYC: BENCHMARKS.md, "dtype")."""
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
    dtype: torch.dtype
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
        cls, path: str | Path, dtype: str | torch.dtype = "auto", max_model_len: int | None = None
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
        checkpoint_dtype = parse_dtype(
            text.get("torch_dtype") or text.get("dtype") or "float32", torch.float32
        )
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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache, sized by `num_blocks`, else `kv_cache_memory_bytes`, else (None, the
    default: "auto") from the memory free once the model is loaded: `memory_utilization` of it
    on CPU; on CUDA what keeps (1 - memory_utilization) of the device free, as vLLM's
    --gpu-memory-utilization. Auto never takes more than every running request at
    max_model_len could fill."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be ≥ 1, got {self.num_blocks}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")


SCHEDULING_POLICIES = ("fcfs", "priority")
"""fcfs: first come, first served (a request's priority must stay 0); priority: lowest
(priority, arrival time) first, as vLLM's --scheduling-policy."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step, the encoder's own budget (tokens / embeddings), the scheduling policy."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap beyond the step budget
    encoder_compute_budget: int = 0  # embeddings encoded per step; 0 = derive (see EngineConfig)
    encoder_cache_size: int = 0  # embeddings kept in the encoder cache; 0 = derive
    max_waiting_requests: int = 0  # 0 = unbounded
    scheduling_policy: str = "fcfs"  # "fcfs", or "priority": lower `priority` first, then arrival

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be ≥ 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be ≥ 1, got {self.max_num_batched_tokens}")


DEFAULT_IMAGES_PER_PROMPT = 8
"""Images one prompt may carry when `limit_per_prompt` does not name "image"."""
DEFAULT_VIDEOS_PER_PROMPT = 1
"""Videos one prompt may carry when `limit_per_prompt` does not name "video"."""


PROCESSOR_KWARGS = ("min_pixels", "max_pixels")
"""The image-processor settings --mm-processor-kwargs may override (they enter every image's hash)."""


@dataclass(frozen=True)
class MultiModalConfig:
    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": DEFAULT_IMAGES_PER_PROMPT})
    processor_cache_bytes: int = 1 << 30
    preprocess_workers: int | None = None  # None = min(4, cpu count); 0 = in-process
    # How media are loaded, per modality (vLLM's --media-io-kwargs): {"video": {"num_frames": 16}}
    media_io_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Image-processor overrides for every request (vLLM's --mm-processor-kwargs): min/max_pixels
    processor_kwargs: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.limit_per_prompt) - {"image", "video"}
        if unknown:
            raise ValueError(f"limit_mm_per_prompt names unknown modalities {sorted(unknown)} (image, video)")
        unknown = set(self.processor_kwargs) - set(PROCESSOR_KWARGS)
        if unknown:
            raise ValueError(
                f"mm_processor_kwargs sets {sorted(unknown)}; mmserve takes {', '.join(PROCESSOR_KWARGS)}"
            )

    @property
    def max_images_per_prompt(self) -> int:
        return self.limit_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)

    @property
    def max_videos_per_prompt(self) -> int:
        return self.limit_per_prompt.get("video", DEFAULT_VIDEOS_PER_PROMPT)


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
"""auto: the fastest that works on the device; torch: the plain-torch reference; cpu: the C++
kernels (csrc/); triton: the Triton kernels (CUDA, or Triton's interpreter on CPU)."""


@dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs on its device: which kernels, how many CPU threads."""

    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (see mmserve.layers.attention)
    num_threads: int | None = None  # engine's torch threads on CPU; None = MMSERVE_NUM_THREADS or all cores

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be ≥ 1, got {self.num_threads}")


@dataclass(frozen=True)
class EngineConfig:
    """All slices together, for the code that wires components (each still gets only its slice)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    multimodal: MultiModalConfig
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    seed: int = 0
    device: str | None = None  # None = cuda when available, else cpu

    @property
    def max_item_tokens(self) -> int:
        """Tokens of the largest image or video item a prompt may carry (never more than the
        context: a longer item could not be used anyway)."""
        largest = self.model.max_image_tokens
        if self.multimodal.max_videos_per_prompt > 0:
            largest = max(largest, min(self.model.max_video_tokens, self.model.max_model_len))
        return largest

    @property
    def encoder_budget(self) -> int:
        """Embeddings encoded per step: by default exactly the largest item the processor can
        produce, so any image or video can be scheduled, while one step never encodes more than
        that (a step that encodes several large items stalls every decoding request behind it)."""
        return self.scheduler.encoder_compute_budget or self.max_item_tokens

    @property
    def encoder_cache_size(self) -> int:
        """Embeddings kept: at least a step's worth of tokens, so chunked prefill through images
        and requests sharing an image do not evict each other's embeddings (as vLLM sizes it)."""
        return self.scheduler.encoder_cache_size or max(
            self.scheduler.max_num_batched_tokens, self.max_item_tokens, self.encoder_budget
        )


def field_default(config_class: type, name: str) -> Any:
    """The default of one field of a config dataclass, for the places that must agree with it
    (`EngineArgs`, the CLI's flags); a fresh copy where the default is made by a factory."""
    spec = {f.name: f for f in dataclasses.fields(config_class)}[name]
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    if spec.default is dataclasses.MISSING:
        raise ValueError(f"{config_class.__name__}.{name} has no default")
    return spec.default


_GIB = 1 << 30


@dataclass(frozen=True)
class EngineArgs:
    """What a user sets for the engine: the keyword arguments of `LLM(...)` and the flags of
    `mmserve serve` (`--max-num-seqs` is `max_num_seqs`), named like vLLM's engine args. The
    defaults are read from the config slices, so `--help` and `LLM(...)` cannot disagree."""

    model: str | Path
    dtype: str = "auto"  # the checkpoint's
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = field_default(SchedulerConfig, "max_num_seqs")
    max_num_batched_tokens: int = field_default(SchedulerConfig, "max_num_batched_tokens")
    long_prefill_token_threshold: int = field_default(SchedulerConfig, "long_prefill_token_threshold")
    encoder_compute_budget: int = field_default(SchedulerConfig, "encoder_compute_budget")
    encoder_cache_size: int = field_default(SchedulerConfig, "encoder_cache_size")
    max_waiting_requests: int = field_default(SchedulerConfig, "max_waiting_requests")
    scheduling_policy: str = field_default(SchedulerConfig, "scheduling_policy")
    block_size: int = field_default(CacheConfig, "block_size")
    num_kv_blocks: int | None = field_default(CacheConfig, "num_blocks")
    kv_cache_memory: int | None = field_default(CacheConfig, "kv_cache_memory_bytes")  # bytes; None = auto
    memory_utilization: float = field_default(CacheConfig, "memory_utilization")
    enable_prefix_caching: bool = field_default(CacheConfig, "enable_prefix_caching")
    limit_mm_per_prompt: dict[str, int] = field(
        default_factory=lambda: field_default(MultiModalConfig, "limit_per_prompt")
    )
    mm_processor_cache_gb: float = field_default(MultiModalConfig, "processor_cache_bytes") / _GIB
    media_io_kwargs: dict[str, dict[str, Any]] = field(
        default_factory=lambda: field_default(MultiModalConfig, "media_io_kwargs")
    )
    preprocess_workers: int | None = field_default(MultiModalConfig, "preprocess_workers")
    mm_processor_kwargs: dict[str, int] = field(
        default_factory=lambda: field_default(MultiModalConfig, "processor_kwargs")
    )
    attention_backend: str = field_default(ExecutionConfig, "attention_backend")
    num_threads: int | None = field_default(ExecutionConfig, "num_threads")
    seed: int = field_default(EngineConfig, "seed")
    device: str | None = field_default(EngineConfig, "device")

    def create_engine_config(self) -> EngineConfig:
        """Read the model folder and build every slice (raises FileNotFoundError / ValueError).

        dtype "auto" is the checkpoint's, except on a CPU that cannot compute it natively, where
        it is float32 (a bf16 checkpoint then runs in float32, as fast and exact)."""
        model = ModelConfig.from_pretrained(self.model, self.dtype, self.max_model_len)
        on_cpu = (self.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
        if self.dtype == "auto" and on_cpu and not cpu_computes_natively(model.dtype):
            model = dataclasses.replace(model, dtype=torch.float32)
        max_pixels = (self.mm_processor_kwargs or {}).get("max_pixels")
        if max_pixels:  # the encoder budget follows the server's image bound
            factor = model.vision.patch_size * model.vision.spatial_merge_size
            model = dataclasses.replace(model, max_image_tokens=max_pixels // (factor * factor))
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory,
                enable_prefix_caching=self.enable_prefix_caching,
                memory_utilization=self.memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=model.max_model_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                encoder_compute_budget=self.encoder_compute_budget,
                encoder_cache_size=self.encoder_cache_size,
                max_waiting_requests=self.max_waiting_requests,
                scheduling_policy=self.scheduling_policy,
            ),
            multimodal=MultiModalConfig(
                limit_per_prompt=dict(self.limit_mm_per_prompt or {}),
                processor_cache_bytes=int(self.mm_processor_cache_gb * _GIB),
                preprocess_workers=self.preprocess_workers,
                media_io_kwargs=dict(self.media_io_kwargs or {}),
                processor_kwargs=dict(self.mm_processor_kwargs or {}),
            ),
            execution=ExecutionConfig(attention_backend=self.attention_backend, num_threads=self.num_threads),
            seed=self.seed,
            device=self.device,
        )


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's settings (the engine's are in EngineConfig); the CLI's flags read their
    defaults here. Callbacks (what to do if EngineCore dies) are passed beside it, not in it."""

    served_model_name: str  # the name answers carry and metrics are labelled with
    served_model_aliases: tuple[str, ...] = ()  # further names requests may use (vLLM's extra names)
    chat_template: str | None = None  # Jinja source replacing the model folder's (--chat-template)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' on /v1 and the tokenizer routes
    allowed_local_media_path: str | None = None  # None = no file:// or local-path images
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) images may come from
    max_body_bytes: int = 64 << 20

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)
