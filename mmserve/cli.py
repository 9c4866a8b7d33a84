"""`mmserve serve [MODEL_DIR] [flags]` (vLLM's flag names where they exist) and `mmserve bench`.

The flags are defined in serve_args.py. This module imports almost nothing at its top: spawned
children (EngineCore, preprocess workers) import the main module again, and must not pay for
torch or the benchmark package there. The benchmark package loads only when `bench` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmserve.config import EngineConfig, ServerConfig

DEMO_MODEL = Path(__file__).resolve().parents[1] / "assets" / "demo-model"
logger = logging.getLogger("mmserve.cli")


def raise_open_file_limit() -> None:
    """Every client holds a socket: lift the soft descriptor limit to the hard one, as servers
    do (`--max-connections` is then kept under it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(args: argparse.Namespace) -> int:
    """Check what can be checked at once (flags, model folder, port), then load and serve; a
    problem found before loading is one line on stderr and exit status 2."""
    from mmserve import envs
    from mmserve.entrypoints import preflight, vllm_flags
    from mmserve.entrypoints.serve_args import engine_args_from_cli, server_config_from_cli

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    envs.set_log_level(args.log_level)  # for the spawned EngineCore and preprocess workers
    raise_open_file_limit()
    if args.model is None:
        if not (DEMO_MODEL / "config.json").is_file():
            print(f"no model given and the bundled demo model is missing at {DEMO_MODEL}", file=sys.stderr)
            return 2
        args.model = str(DEMO_MODEL)
    problems = vllm_flags.refusals(args) + [
        problem
        for problem in (
            preflight.model_folder_problem(args.model),
            preflight.port_problem(args.host, args.port),
        )
        if problem
    ]
    if problems:
        print("\n".join(f"mmserve: {problem}" for problem in problems), file=sys.stderr)
        return 2
    for note in vllm_flags.no_effect_notes(args):
        logger.info(note)
    try:
        engine_config = engine_args_from_cli(args).create_engine_config()
        server_config = server_config_from_cli(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mmserve: {e}", file=sys.stderr)
        return 2
    return run_server(engine_config, server_config, args.uvicorn_log_level or args.log_level)


def run_server(engine_config: EngineConfig, server_config: ServerConfig, uvicorn_log_level: str) -> int:
    """Serve until stopped: 0 after a clean stop (SIGTERM drains first, see http_server.py;
    Ctrl+C included), 1 if the server never started or EngineCore died (so a supervisor
    restarts it)."""
    from mmserve.entrypoints.openai.api_server import build_app
    from mmserve.entrypoints.openai.drain import Drain
    from mmserve.entrypoints.openai.http_server import DrainingServer, build_server
    from mmserve.process_name import set_process_name

    set_process_name("mmserve-api")
    engine_died = False
    server: DrainingServer | None = None

    def on_engine_dead() -> None:
        nonlocal engine_died
        engine_died = True
        if server is not None:
            server.should_exit = True

    server_config = fit_connection_limit(server_config)
    drain = Drain(server_config.shutdown_timeout_s)
    app = build_app(engine_config, server_config, on_engine_dead, drain)
    server = build_server(app, server_config, uvicorn_log_level, drain.begin)
    interrupted = False
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        # uvicorn shuts down gracefully on Ctrl+C, then raises the signal again for the caller;
        # whether asyncio turns that into KeyboardInterrupt depends on where serve() is by then.
        interrupted = True
    if interrupted or server.interrupted:
        print("mmserve: stopped", file=sys.stderr)
    if engine_died:
        print("mmserve: EngineCore died; exiting with status 1", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def fit_connection_limit(server_config: ServerConfig) -> ServerConfig:
    """Keep the connection cap under the descriptor limit (with room for the engine's sockets,
    pipes and files): past the limit accept() fails and no one gets the clear 503."""
    import dataclasses
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft - _RESERVED_DESCRIPTORS
    if soft == resource.RLIM_INFINITY or server_config.max_connections <= room:
        return server_config
    logging.getLogger("mmserve.cli").warning(
        "--max-connections %d lowered to %d: the open-file limit is %d",
        server_config.max_connections,
        max(1, room),
        soft,
    )
    return dataclasses.replace(server_config, max_connections=max(1, room))


_RESERVED_DESCRIPTORS = 256


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The `bench` command's flags are added only when `argv` runs it: they come from the
    benchmark package, which `serve` never needs to import."""
    from mmserve.entrypoints.serve_args import add_serve_arguments

    parser = argparse.ArgumentParser(prog="mmserve", description="Serve vision-language models.")
    parser.add_argument("--version", action="version", version=f"mmserve {version('mmserve')}")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="Start the OpenAI-compatible server."))
    bench_parser = commands.add_parser("bench", help="Benchmarks against a running server.")
    if argv[:1] == ["bench"]:
        from mmserve.bench.serve import add_bench_serve_arguments

        bench_commands = bench_parser.add_subparsers(dest="bench_command", required=True)
        add_bench_serve_arguments(
            bench_commands.add_parser(
                "serve", help="VisionArena-style load against an OpenAI-compatible server."
            )
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Ctrl+C at any point ends the program with one line, not a traceback (status 130)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        if args.command == "serve":
            return serve(args)
        from mmserve.bench.serve import run_bench_serve

        return run_bench_serve(args)
    except KeyboardInterrupt:
        print("mmserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
