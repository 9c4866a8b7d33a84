"""The flags of `mmserve serve` and what they build: `EngineArgs` and `ServerConfig`.

Every engine flag is the `EngineArgs` field of the same name (`--max-num-seqs` is
`max_num_seqs`) and every server flag a `ServerConfig` field; the flags' defaults are read from
those classes, so `--help` states what `LLM(...)` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from mmserve import envs
from mmserve.config import (
    ATTENTION_BACKENDS,
    EXECUTOR_BACKENDS,
    MM_ENCODER_TP_MODES,
    SCHEDULING_POLICIES,
    ServerConfig,
    field_default,
)
from mmserve.engine_args import EngineArgs
from mmserve.entrypoints.flag_parsers import (
    format_bytes,
    parse_bytes,
    parse_compilation_config,
    parse_kv_cache_memory,
    parse_limit_mm,
    parse_list,
    parse_media_io_kwargs,
    parse_mm_processor_kwargs,
)
from mmserve.entrypoints.vllm_flags import add_vllm_flags, load_chat_template


def _engine_flag(group: argparse._ArgumentGroup, name: str, help_text: str, *aliases: str, **options) -> None:
    """--name-with-dashes (and `aliases`) for the EngineArgs field `name`, with its default."""
    flag = "--" + name.replace("_", "-")
    group.add_argument(
        flag, *aliases, dest=name, default=field_default(EngineArgs, name), help=help_text, **options
    )


def _server_flag(group: argparse._ArgumentGroup, flag: str, name: str, help_text: str, **options) -> None:
    """`flag` for the ServerConfig field `name`, with that field's default."""
    group.add_argument(flag, default=field_default(ServerConfig, name), help=help_text, **options)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="Hugging Face model folder (default: the bundled demo model)."
    )
    _add_server_arguments(parser.add_argument_group("server"))
    _add_safety_arguments(parser.add_argument_group("browser safety and connections"))
    _add_scheduler_arguments(parser.add_argument_group("model and scheduling"))
    _add_cache_arguments(parser.add_argument_group("KV cache"))
    _add_multimodal_arguments(parser.add_argument_group("images"))
    _add_parallel_arguments(parser.add_argument_group("tensor parallelism"))
    add_vllm_flags(parser.add_argument_group("vLLM compatibility"))


def _add_server_arguments(group: argparse._ArgumentGroup) -> None:
    _server_flag(group, "--host", "host", "Address to listen on (default %(default)s).")
    _server_flag(group, "--port", "port", "Port to listen on (default %(default)s).", type=int)
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model ids in the API; answers and metrics carry the first (default: the folder's name).",
    )
    _server_flag(
        group,
        "--api-key",
        "api_key",
        "Require 'Authorization: Bearer KEY' on /v1 routes (or set MMSERVE_API_KEY).",
    )
    _server_flag(
        group,
        "--allowed-local-media-path",
        "allowed_local_media_path",
        "Directory whose files may be sent as file:// images.",
    )
    _server_flag(
        group,
        "--allowed-media-domains",
        "allowed_media_domains",
        "Hosts from which http(s) images may be fetched.",
        nargs="*",
    )
    max_body = format_bytes(field_default(ServerConfig, "max_body_bytes"))
    _server_flag(
        group,
        "--max-request-body",
        "max_body_bytes",
        f"Largest request body accepted; larger ones get 413 (default {max_body}).",
        type=parse_bytes,
    )
    group.add_argument("--log-level", default=envs.log_level(), help="debug, info, warning or error.")
    _add_files_arguments(group)


def _add_files_arguments(group: argparse._ArgumentGroup) -> None:
    """The Files API (/v1/files): uploaded images referred to by id in chat messages."""
    _server_flag(group, "--files-dir", "files_dir", "Folder of uploaded files (default: a temporary one).")
    _server_flag(
        group, "--files-quota", "files_quota_bytes", "Bytes of uploads kept per API key.", type=parse_bytes
    )
    _server_flag(
        group, "--files-max-count", "files_quota_count", "Uploaded files kept per API key.", type=int
    )
    _server_flag(group, "--files-ttl", "files_ttl_s", "Seconds an uploaded file is kept.", type=float)
    _server_flag(group, "--max-file-size", "max_file_bytes", "Largest uploaded file.", type=parse_bytes)


def _add_safety_arguments(group: argparse._ArgumentGroup) -> None:
    _server_flag(
        group,
        "--allow-special-tokens-in-content",
        "allow_special_tokens_in_content",
        "Let special-token text in chat messages (e.g. <|im_start|>) become control tokens, as "
        "vLLM does; by default it is plain text, so a user cannot forge another role.",
        action="store_true",
    )
    group.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=None,
        help="Host names the server answers to ('*' any; '*.example.com' subdomains). Default: "
        "localhost, 127.0.0.1 and ::1 when bound to a loopback address (DNS-rebinding safe), any otherwise.",
    )
    for flag, name, what in (
        (
            "--allowed-origins",
            "allowed_origins",
            "Origins whose web pages may call the API (CORS); '*' for any.",
        ),
        ("--allowed-methods", "allowed_methods", "Methods allowed cross-origin (default %(default)s)."),
        ("--allowed-headers", "allowed_headers", "Headers allowed cross-origin (default %(default)s)."),
    ):
        _server_flag(group, flag, name, what + " Space-separated or a JSON list.", nargs="*")
    _server_flag(
        group,
        "--allow-credentials",
        "allow_credentials",
        "Allow credentials cross-origin.",
        action="store_true",
    )
    _server_flag(
        group,
        "--max-connections",
        "max_connections",
        "Most open connections; more are answered 503 (default %(default)s).",
        type=int,
    )
    for flag, name, what in (
        ("--header-timeout", "header_timeout_s", "Seconds a client may take to send a request's headers"),
        ("--read-timeout", "read_timeout_s", "Seconds a request body may pause"),
        ("--keep-alive-timeout", "keep_alive_timeout_s", "Seconds an idle keep-alive connection stays open"),
        (
            "--shutdown-timeout",
            "shutdown_timeout_s",
            "Seconds running requests get to finish after SIGTERM; the rest end with an error",
        ),
    ):
        _server_flag(group, flag, name, what + " (default %(default)s).", type=float)


def _add_scheduler_arguments(group: argparse._ArgumentGroup) -> None:
    _engine_flag(group, "dtype", "auto (the checkpoint's), float32, bfloat16 or float16.")
    _engine_flag(group, "max_model_len", "Context length (default: the model's).", type=int)
    _engine_flag(group, "max_num_seqs", "Most requests running at once (default %(default)s).", type=int)
    _engine_flag(
        group, "max_num_batched_tokens", "Token budget of one engine step (default %(default)s).", type=int
    )
    _engine_flag(
        group,
        "long_prefill_token_threshold",
        "Most prompt tokens one request may take in a step; 0 = no cap.",
        type=int,
    )
    _engine_flag(
        group,
        "max_waiting_requests",
        "Refuse new requests (503) beyond this many waiting; 0 = no cap.",
        type=int,
    )
    _engine_flag(
        group,
        "scheduling_policy",
        "fcfs: first come, first served (requests may not set a priority); priority: lowest "
        "'priority' field first, then arrival (default %(default)s).",
        choices=SCHEDULING_POLICIES,
    )
    _engine_flag(
        group,
        "encoder_compute_budget",
        "Image embeddings encoded per step; 0 = the largest image's.",
        type=int,
    )
    _engine_flag(
        group,
        "encoder_cache_size",
        "Image embeddings kept in the encoder cache; 0 = derived from the budgets.",
        type=int,
    )
    _engine_flag(group, "seed", "Seed of the engine's random state (default %(default)s).", type=int)
    _engine_flag(group, "device", "cpu or cuda (default: cuda when there is one).")
    _engine_flag(
        group,
        "attention_backend",
        "Kernels: auto (the C++ kernels on CPU; on CUDA flash_attn where it is installed and fits, "
        "else Triton), torch (the reference), cpu, triton, flash_attn (default %(default)s).",
        choices=ATTENTION_BACKENDS,
    )
    _engine_flag(
        group,
        "enforce_eager",
        "Run the model eagerly: no torch.compile, no CUDA graphs.",
        action=argparse.BooleanOptionalAction,
    )
    _engine_flag(
        group,
        "compilation_config",
        """JSON, as vLLM's: '{"level": 1, "cudagraph_capture_sizes": [1, 2, 4, 8]}' (level 0 """
        """eager, 1 torch.compile; default: compiled and captured on CUDA, eager on CPU).""",
        type=parse_compilation_config,
    )
    _engine_flag(
        group,
        "num_threads",
        "The engine's CPU threads (default: MMSERVE_NUM_THREADS, else every core this process may use).",
        type=int,
    )
    _engine_flag(
        group,
        "cpu_threads_bind",
        "Pin the engine's CPU threads, one per core: auto (this rank's share of the cores), none (the "
        "OS places them: for machines shared with other jobs), or CPU lists per rank such as 0-3 or "
        "0-1|2-3 (default %(default)s).",
    )


def _add_cache_arguments(group: argparse._ArgumentGroup) -> None:
    _engine_flag(group, "block_size", "Tokens per KV cache block (default %(default)s).", type=int)
    _engine_flag(
        group,
        "kv_cache_memory",
        "KV cache size, e.g. 2GiB, or auto: from the memory free after loading the model (default auto).",
        type=parse_kv_cache_memory,
    )
    _engine_flag(
        group,
        "memory_utilization",
        "With --kv-cache-memory auto: on CPU the fraction of free memory the KV cache may take; on "
        "CUDA the fraction of the device the engine may fill (default %(default)s).",
        "--gpu-memory-utilization",
        type=float,
    )
    _engine_flag(group, "num_kv_blocks", "KV cache size in blocks; overrides --kv-cache-memory.", type=int)
    _engine_flag(
        group,
        "enable_prefix_caching",
        "Reuse KV blocks of earlier requests with the same prefix (images included). On by default.",
        action=argparse.BooleanOptionalAction,
    )


def _add_multimodal_arguments(group: argparse._ArgumentGroup) -> None:
    limit = json.dumps(field_default(EngineArgs, "limit_mm_per_prompt"))
    _engine_flag(
        group,
        "limit_mm_per_prompt",
        f"""JSON, e.g. '{{"image": 4, "video": 1}}' (default '{limit}'; videos 1 where unnamed).""",
        type=parse_limit_mm,
    )
    _engine_flag(
        group,
        "media_io_kwargs",
        """JSON, how videos are sampled unless a request's mm_processor_kwargs says otherwise: """
        """'{"video": {"num_frames": 16}}' or '{"video": {"fps": 2}}' (default: the model's video """
        """processor's fps where it samples, else 32 frames).""",
        type=parse_media_io_kwargs,
    )
    _engine_flag(
        group,
        "mm_processor_cache_gb",
        "GiB of preprocessed pixels kept by the preprocess pool's cache and, apart, by EngineCore's "
        "pixel store, whose images are sent by hash (default %(default)s).",
        type=float,
    )
    _engine_flag(
        group,
        "mm_processor_kwargs",
        """JSON, image-processor settings for every request: '{"min_pixels": 3136, "max_pixels": """
        """1003520}' (default: the model folder's preprocessor_config.json).""",
        type=parse_mm_processor_kwargs,
    )
    _engine_flag(
        group,
        "preprocess_workers",
        "Image preprocessing processes (default min(4, cores); 0 = inline).",
        type=int,
    )


def _add_parallel_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=field_default(EngineArgs, "tensor_parallel_size"),
        help="Ranks the model is split over, one worker process (or Ray actor) each (default %(default)s).",
    )
    _engine_flag(
        group,
        "distributed_executor_backend",
        "mp (worker processes on this machine; the default above one rank), ray (Ray actors "
        "across a Ray cluster's nodes) or uni (in the engine's process; one rank only).",
        choices=EXECUTOR_BACKENDS,
    )
    _engine_flag(
        group,
        "mm_encoder_tp_mode",
        "weights (the vision tower split like the language model) or data (whole on every rank, "
        "each encoding its share of a step's images). Default %(default)s.",
        choices=MM_ENCODER_TP_MODES,
    )


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(EngineArgs)})


def server_config_from_cli(args: argparse.Namespace) -> ServerConfig:
    names = args.served_model_name or [Path(args.model).name]
    return ServerConfig(
        served_model_name=names[0],
        served_model_aliases=tuple(names[1:]),
        chat_template=load_chat_template(args.chat_template),
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.api_key(),
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains),
        max_body_bytes=args.max_request_body,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        allowed_hosts=None if args.allowed_hosts is None else parse_list(args.allowed_hosts),
        allowed_origins=parse_list(args.allowed_origins),
        allow_credentials=args.allow_credentials,
        allowed_methods=parse_list(args.allowed_methods),
        allowed_headers=parse_list(args.allowed_headers),
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout,
        read_timeout_s=args.read_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        files_dir=args.files_dir,
        files_quota_bytes=args.files_quota,
        files_quota_count=args.files_max_count,
        files_ttl_s=args.files_ttl,
        max_file_bytes=args.max_file_size,
    )
