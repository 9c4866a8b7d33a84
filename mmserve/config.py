"""Frozen configuration slices. Each component is handed only the slice it needs.

`ModelConfig` is read from a Hugging Face model folder (`mmserve.model_config`, re-exported
here); the others are built by `mmserve.engine_args.EngineArgs` from what a user sets (the
offline `LLM(...)` keyword arguments or the `mmserve serve` flags). `ServerConfig` is the HTTP
server's own. Derived values
are properties, never written back. Every default is written once, on its slice's field:
`EngineArgs` and the CLI read them from there (`field_default`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from mmserve.model_config import ModelConfig, cpu_computes_natively, parse_dtype

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ExecutionConfig",
    "ModelConfig",
    "MultiModalConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "cpu_computes_natively",
    "field_default",
    "parse_dtype",
]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache, sized by `num_blocks`, else `kv_cache_memory_bytes`, else (None, the
    default: "auto") from the memory free once the model is loaded: on CPU `memory_utilization`
    of it, at most 4 GiB (vLLM-CPU's default); on CUDA what keeps (1 - memory_utilization) of
    the device free, as vLLM's --gpu-memory-utilization. Auto never takes more than every
    running request at max_model_len could fill."""

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


@dataclass(frozen=True)
class MultiModalConfig:
    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": DEFAULT_IMAGES_PER_PROMPT})
    processor_cache_bytes: int = 1 << 30
    preprocess_workers: int | None = None  # None = min(4, cpu count); 0 = in-process
    # How media are loaded, per modality (vLLM's --media-io-kwargs): {"video": {"num_frames": 16}}
    media_io_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Processor overrides for every request (vLLM's --mm-processor-kwargs; which keys a model
    # takes is its family's: mmserve.models.registry checks them); they enter every item's hash
    processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.limit_per_prompt) - {"image", "video"}
        if unknown:
            raise ValueError(f"limit_mm_per_prompt names unknown modalities {sorted(unknown)} (image, video)")

    @property
    def max_images_per_prompt(self) -> int:
        return self.limit_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)

    @property
    def max_videos_per_prompt(self) -> int:
        return self.limit_per_prompt.get("video", DEFAULT_VIDEOS_PER_PROMPT)


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash_attn")
"""auto: the fastest that works on the device; torch: the plain-torch reference; cpu: the C++
kernels (csrc/); triton: the Triton kernels (CUDA, or Triton's interpreter on CPU); flash_attn:
flash-attn's paged varlen kernel (CUDA, fp16/bf16, block sizes that are multiples of 256)."""

COMPILATION_LEVELS = (0, 1)
"""0: the language model runs eagerly; 1: torch.compile of the language model, paged attention
kept out of the traced graph as one opaque op per layer (the pieces between are compiled)."""


@dataclass(frozen=True)
class CompilationConfig:
    """How the language model is compiled and captured (the `--compilation-config` JSON, named
    as vLLM's): `level` one of COMPILATION_LEVELS, None = 1 on CUDA and 0 on CPU (slower there:
    BENCHMARKS.md, "torch.compile ... off by default"); `backend` torch.compile's;
    `cudagraph_capture_sizes` the decode batch sizes captured as CUDA graphs (None = 1, 2, 4,
    then multiples of 8 up to max_num_seqs and at most 512; [] = none)."""

    level: int | None = None
    backend: str = "inductor"
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.level is not None and self.level not in COMPILATION_LEVELS:
            raise ValueError(f"compilation level must be one of {COMPILATION_LEVELS}, got {self.level!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and not all(isinstance(s, int) and s >= 1 for s in sizes):
            raise ValueError(f"cudagraph_capture_sizes must be integers ≥ 1, got {list(sizes)}")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> CompilationConfig:
        """From the flag's JSON object; unknown keys are an error that names the known ones."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"compilation_config has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        if values.get("cudagraph_capture_sizes") is not None:
            values["cudagraph_capture_sizes"] = tuple(values["cudagraph_capture_sizes"])
        return cls(**values)

    def compiles(self, device_type: str) -> bool:
        """Whether the language model is compiled on a device of `device_type` ("cpu",
        "cuda"; level None: only on CUDA)."""
        level = self.level if self.level is not None else int(device_type == "cuda")
        return level >= 1


@dataclass(frozen=True)
class ExecutionConfig:
    """How the model runs on its device: which kernels, how many CPU threads, whether the
    language model is compiled and its decode steps replayed as CUDA graphs (`enforce_eager`
    turns both off, as vLLM's flag does)."""

    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (see mmserve.layers.attention)
    num_threads: int | None = None  # engine's torch threads on CPU; None = MMSERVE_NUM_THREADS or all cores
    cpu_threads_bind: str = "auto"  # auto | none | CPU lists per rank, e.g. 0-1|2-3 (worker/cpu_threads.py)
    enforce_eager: bool = False
    compilation: CompilationConfig = field(default_factory=CompilationConfig)

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be ≥ 1, got {self.num_threads}")
        if not re.fullmatch(r"auto|none|[0-9,|-]+", self.cpu_threads_bind):
            raise ValueError(
                "cpu_threads_bind must be auto, none or CPU lists such as 0-3 or 0-1|2-3, "
                f"got {self.cpu_threads_bind!r}"
            )


EXECUTOR_BACKENDS = ("mp", "ray", "uni")
"""mp: one worker process per rank on this machine; ray: the workers are Ray actors placed on a
Ray cluster's nodes; uni: the one worker in the EngineCore's own process (one rank only)."""
MM_ENCODER_TP_MODES = ("weights", "data")
"""weights: the vision tower's layers are split across ranks like the language model's; data:
every rank holds the whole tower and encodes its share of a step's images (vLLM's
--mm-encoder-tp-mode)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across devices: tensor parallel over `tensor_parallel_size` ranks."""

    tensor_parallel_size: int = 1
    # None = uni for one rank, mp for more (a Ray cluster is used only when asked for)
    distributed_executor_backend: str | None = None
    mm_encoder_tp_mode: str = "weights"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be ≥ 1, got {self.tensor_parallel_size}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got {backend!r}"
            )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank; use mp or ray for more")
        if self.mm_encoder_tp_mode not in MM_ENCODER_TP_MODES:
            raise ValueError(
                f"mm_encoder_tp_mode must be one of {', '.join(MM_ENCODER_TP_MODES)}, "
                f"got {self.mm_encoder_tp_mode!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")


def check_model_fits(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse, before any worker starts, a split the model's shapes do not allow: attention heads
    and MLP widths divide evenly over the ranks, and the KV heads either divide over them or
    (fewer KV heads than ranks) each is replicated on a whole number of ranks, as in vLLM."""
    tp = parallel.tensor_parallel_size
    kv = model.num_kv_heads
    for name, value in model.split_widths(split_encoder=parallel.mm_encoder_tp_mode == "weights").items():
        if value % tp:
            hint = " (try --mm-encoder-tp-mode data)" if name.startswith("vision") else ""
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {name} {value}{hint}")
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the model's {kv} KV heads or be a multiple of them"
        )


@dataclass(frozen=True)
class EngineConfig:
    """All slices together, for the code that wires components (each still gets only its slice)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    multimodal: MultiModalConfig
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
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


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's settings (the engine's are in EngineConfig); the CLI's flags read their
    defaults here. Callbacks (what to do if EngineCore dies) are passed beside it, not in it."""

    served_model_name: str  # the name answers carry and metrics are labelled with
    served_model_aliases: tuple[str, ...] = ()  # further names requests may use (vLLM's extra names)
    chat_template: str | None = None  # Jinja source replacing the model folder's (--chat-template)
    host: str = "127.0.0.1"
    port: int = 8000
    # required as 'Authorization: Bearer KEY' on /v1 and the tokenizer routes; several keys are
    # separated by commas (each key sees only the files it uploaded)
    api_key: str | None = None
    allowed_local_media_path: str | None = None  # None = no file:// or local-path images
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) images may come from
    max_body_bytes: int = 64 << 20
    # Message content's special-token text is plain text unless this is set (role injection).
    allow_special_tokens_in_content: bool = False
    # Browser safety. Host names the server answers to (None: the loopback names when bound to
    # a loopback address, any name otherwise; a leading "*." matches subdomains), and origins
    # whose pages may call it across origins (CORS; vLLM's flags). Same-origin pages always may.
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    # Connections: how many may be open (more get a 503), how long a client may take to send a
    # request's headers, how long it may pause while sending a body, how long an idle
    # keep-alive connection stays open, and how long running requests get to finish at SIGTERM.
    max_connections: int = 2048
    header_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    shutdown_timeout_s: float = 5.0
    # The Files API: where uploads live, per-key quotas, expiry, the largest upload.
    files_dir: str | None = None  # where uploaded files live (None: a temporary folder, gone at exit)
    files_quota_bytes: int = 1 << 30  # per API key
    files_quota_count: int = 1000  # per API key
    files_ttl_s: float | None = 7 * 24 * 3600.0  # uploaded files expire this long after upload
    max_file_bytes: int = 20 << 20  # one uploaded file

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(key for key in (self.api_key or "").split(",") if key)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def served_hosts(self) -> tuple[str, ...]:
        """The Host names answered: ("*",) for any."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        if self.host in LOOPBACK_NAMES or self.host.startswith("127."):
            return tuple(dict.fromkeys((*LOOPBACK_NAMES, self.host)))
        return ("*",)


# What a client on this machine may call a loopback-bound server. Anything else reaching it
# came through a proxy or a DNS name pointed at 127.0.0.1 by a web page (DNS rebinding).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
