"""`mmserve serve [MODEL_DIR] [flags]` (vLLM's flag names where they exist) and `mmserve bench`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from pathlib import Path

from mmserve import envs

DEMO_MODEL = Path(__file__).resolve().parents[2] / "assets" / "demo-model"
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'2147483648', '2GiB', '1.5 GB' → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_limit_mm(text: str) -> dict[str, int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"--limit-mm-per-prompt takes JSON like '{{\"image\": 4}}', got {text!r}"
        ) from None
    if not isinstance(value, dict) or not all(isinstance(v, int) and v >= 0 for v in value.values()):
        raise argparse.ArgumentTypeError("--limit-mm-per-prompt maps modality names to counts ≥ 0")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help="Hugging Face model folder (default: the bundled demo model)."
    )
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
    p.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    p.add_argument(
        "--served-model-name", default=None, help="Model id in the API (default: the folder's name)."
    )
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16.")
    p.add_argument("--max-model-len", type=int, default=None, help="Context length (default: the model's).")
    p.add_argument("--max-num-seqs", type=int, default=128, help="Most requests running at once.")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="Token budget of one engine step."
    )
    p.add_argument("--block-size", type=int, default=16, help="Tokens per KV cache block.")
    p.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=parse_bytes("2GiB"), help="KV cache size, e.g. 2GiB."
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse KV blocks of earlier requests with the same prefix (images included). On by default.",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=parse_limit_mm,
        default={"image": 8},
        help="""JSON, e.g. '{"image": 4}'.""",
    )
    p.add_argument(
        "--mm-processor-cache-gb", type=float, default=1.0, help="Size of the preprocessed-image cache."
    )
    p.add_argument(
        "--preprocess-workers",
        type=int,
        default=None,
        help="Image preprocessing processes (default min(4, cores); 0 = inline).",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="Directory whose files may be sent as file:// images.",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        help="Hosts from which http(s) images may be fetched.",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on /v1 routes (or set MMSERVE_API_KEY).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the engine's random state.")
    p.add_argument("--log-level", default=envs.log_level(), help="debug, info, warning or error.")
    p.add_argument(
        "--max-request-body",
        type=parse_bytes,
        default=parse_bytes("64MiB"),
        help="Largest request body accepted; larger ones get 413 (default 64MiB).",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=0,
        help="Refuse new requests (503) beyond this many waiting; 0 = no cap.",
    )


def engine_config_from_args(args: argparse.Namespace):
    from mmserve.config import CacheConfig, EngineConfig, ModelConfig, MultiModalConfig, SchedulerConfig

    model = ModelConfig.from_pretrained(args.model, args.dtype, args.max_model_len)
    return EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=model.max_model_len,
            max_waiting_requests=args.max_waiting_requests,
        ),
        multimodal=MultiModalConfig(
            limit_per_prompt=args.limit_mm_per_prompt,
            processor_cache_bytes=int(args.mm_processor_cache_gb * (1 << 30)),
            preprocess_workers=args.preprocess_workers,
        ),
        seed=args.seed,
    )


def raise_open_file_limit() -> None:
    """Every cached preprocessed image keeps a shared-memory mapping (one descriptor) open, and
    every client a socket: lift the soft descriptor limit to the hard one, as servers do."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from mmserve.entrypoints.openai.api_server import ServerSettings, build_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    raise_open_file_limit()
    if args.model is None:
        if not (DEMO_MODEL / "config.json").is_file():
            print(f"no model given and the bundled demo model is missing at {DEMO_MODEL}", file=sys.stderr)
            return 2
        args.model = str(DEMO_MODEL)
    try:
        config = engine_config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mmserve: {e}", file=sys.stderr)
        return 2
    engine_died = False
    server: uvicorn.Server | None = None

    def on_engine_dead() -> None:
        nonlocal engine_died
        engine_died = True
        if server is not None:
            server.should_exit = True

    settings = ServerSettings(
        engine=config,
        served_model_name=args.served_model_name or Path(args.model).name,
        api_key=args.api_key or envs.api_key(),
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
        max_body_bytes=args.max_request_body,
        on_engine_dead=on_engine_dead,
    )
    app = build_app(settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=1
        )
    )
    asyncio.run(server.serve())
    if engine_died:
        print("mmserve: EngineCore died; exiting with status 1", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve", description="Serve vision-language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="Start the OpenAI-compatible server.")
    add_serve_arguments(serve_parser)
    bench_parser = commands.add_parser("bench", help="Benchmarks against a running server.")
    bench_commands = bench_parser.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_commands.add_parser(
        "serve", help="VisionArena-style load against an OpenAI-compatible server."
    )
    from mmserve.bench.serve import add_bench_serve_arguments, run_bench_serve

    add_bench_serve_arguments(bench_serve)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return run_bench_serve(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
