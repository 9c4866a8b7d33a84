"""`mmserve bench serve`: vLLM's `bench serve` for VisionArena-style chat against any OpenAI server.

    mmserve bench serve --dataset-path DIR --num-prompts 100 --max-concurrency 8 --output-len 32

The CLI wires `add_bench_serve_arguments` and `run_bench_serve`; `benchmark` is the same run for
callers that already hold parsed arguments (the side-by-side driver). Exit status 0 when every
request succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

from mmserve.bench.client import Endpoint
from mmserve.bench.dataset import HF_NAME, load_conversations
from mmserve.bench.metrics import compute_metrics, request_bytes_by_turn, ttft_by_turn
from mmserve.bench.report import (
    distribution_json,
    format_bytes_report,
    format_report,
    format_turn_report,
    metrics_json,
)
from mmserve.bench.runner import LoadShape, run_multi_turn, run_single_turn
from mmserve.bench.workload import sample_conversations, sample_single_turn


def _rates(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are comma-separated numbers or inf, got {text!r}") from None


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="Server URL (default http://HOST:PORT).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/chat/completions", help="Chat completions path.")
    p.add_argument("--model", default=None, help="Model id to send (default: the server's first model).")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token, if any.")
    p.add_argument(
        "--dataset-path",
        default=HF_NAME,
        help="A folder with data/train-*.parquet in VisionArena-Chat's schema, or a Hub dataset name.",
    )
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--num-prompts", type=int, default=1000, help="Requests (conversations in --multi-turn).")
    p.add_argument("--output-len", type=int, default=128, help="max_completion_tokens of every request.")
    p.add_argument("--ignore-eos", action="store_true", help="Send ignore_eos (vLLM's extension).")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Requests per second (inf: all at once)."
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of arrival gaps (1 = Poisson).")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight.")
    p.add_argument("--seed", type=int, default=0, help="Seeds the sampling of rows and the arrivals.")
    p.add_argument(
        "--num-warmups", type=int, default=0, help="Untimed requests first (rows not benchmarked)."
    )
    p.add_argument("--percentiles", type=_rates, default=[50.0, 90.0, 99.0], help="e.g. 50,90,99")
    p.add_argument("--multi-turn", action="store_true", help="Play whole conversations, history resent.")
    p.add_argument(
        "--image-refs",
        choices=("data-url", "file"),
        default="data-url",
        help="--multi-turn: resend images as data URLs (as chat UIs do), or upload each once to "
        "/v1/files when its conversation starts and refer to it by id.",
    )
    p.add_argument(
        "--video-num-frames",
        type=int,
        default=None,
        help="Frames sampled from each video of the video mix (default: the server's --media-io-kwargs).",
    )
    p.add_argument("--sweep-rates", type=_rates, default=None, help="e.g. 1,2,4,inf: one run per rate.")
    p.add_argument(
        "--plot-file",
        default=None,
        help="PNG of latency/throughput against the rate (each of --sweep-rates).",
    )
    p.add_argument("--result-file", default=None, help="Write the results here as JSON.")
    p.add_argument("--label", default="", help="Free text stored in the result file.")
    p.add_argument("--quiet", action="store_true", help="No progress bar.")


def machine_facts() -> dict:
    return {"cpu_count": os.cpu_count(), "loadavg_1_5_15": list(os.getloadavg())}


def endpoint_from_args(args: argparse.Namespace) -> Endpoint:
    base = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model
    if model is None:
        models = httpx.get(base.rstrip("/") + "/v1/models", timeout=30).json()["data"]
        model = models[0]["id"]
    return Endpoint(base, model, args.endpoint, args.api_key)


def benchmark(args: argparse.Namespace, endpoint: Endpoint, dataset=None, skip_rows: int = 0) -> dict:
    """Run the workload once per rate (just --request-rate without --sweep-rates); print the
    reports; return the result document that --result-file stores. `skip_rows` leaves out the
    first rows of the seeded sample (disjoint samples for repeated rounds)."""
    dataset = dataset if dataset is not None else load_conversations(args.dataset_path, args.dataset_split)
    num_total = skip_rows + args.num_prompts + args.num_warmups
    if args.multi_turn:
        work = sample_conversations(dataset, num_total, args.seed)[skip_rows:]
        warmups = [c.first_turn() for c in work[args.num_prompts :]]
    else:
        work = sample_single_turn(dataset, num_total, args.seed)[skip_rows:]
        warmups = work[args.num_prompts :]
    work = work[: args.num_prompts]
    runs = []
    for rate in args.sweep_rates or [args.request_rate]:
        video_options = {"num_frames": args.video_num_frames} if args.video_num_frames else None
        shape = LoadShape(
            rate,
            args.burstiness,
            args.max_concurrency,
            args.output_len,
            args.ignore_eos,
            args.seed,
            video_options,
            args.image_refs,
        )
        run = run_multi_turn if args.multi_turn else run_single_turn
        load_before = os.getloadavg()[0]
        results, duration = asyncio.run(run(endpoint, work, shape, warmups, quiet=args.quiet))
        m = compute_metrics(results, duration, args.percentiles)
        print(format_report(m, args.max_concurrency, rate, model=endpoint.model, dataset=args.dataset_path))
        entry = {"request_rate": rate, "loadavg_1min_before": load_before} | metrics_json(m)
        if args.multi_turn:
            by_turn = ttft_by_turn(results, args.percentiles)
            print(format_turn_report(by_turn))
            entry["ttft_by_turn"] = {str(t + 1): distribution_json(d) for t, d in by_turn.items()}
            bytes_by_turn = request_bytes_by_turn(results)
            print(format_bytes_report(bytes_by_turn))
            entry["request_bytes_by_turn"] = {str(t + 1): b for t, b in bytes_by_turn.items()}
        errors = sorted({r.error for r in results if not r.success})
        if errors:
            print(f"errors ({len(errors)} distinct): {errors[:3]}", file=sys.stderr)
            entry["errors"] = errors[:20]
        runs.append(entry)
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "label": args.label,
        "base_url": endpoint.base_url,
        "model": endpoint.model,
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "max_concurrency": args.max_concurrency,
        "burstiness": args.burstiness,
        "multi_turn": args.multi_turn,
        "image_refs": args.image_refs,
        "seed": args.seed,
        "machine": machine_facts(),
        "runs": runs,
    }


def dataset_problem(dataset_path: str, hub_reachable=None) -> str | None:
    """Why the dataset cannot be loaded, said at once (None when it may be): a name that is no
    local folder needs the Hugging Face Hub, which `datasets` would otherwise retry for half a
    minute before a raw ConnectionError."""
    if Path(dataset_path).expanduser().exists():
        return None
    if (hub_reachable or _hub_reachable)():
        return None
    return (
        f"--dataset-path {dataset_path!r} is not a local folder and the Hugging Face Hub cannot be "
        "reached. Write a VisionArena-format dataset offline with\n"
        "  python benchmarks/make_visionarena_dataset.py DIR --num-rows 500\n"
        "and pass --dataset-path DIR."
    )


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def run_bench_serve(args: argparse.Namespace) -> int:
    problem = dataset_problem(args.dataset_path)
    if args.image_refs == "file" and not args.multi_turn:
        problem = "--image-refs file needs --multi-turn (images are uploaded once per conversation)"
    if problem:
        print(f"mmserve bench serve: {problem}", file=sys.stderr)
        return 2
    endpoint = endpoint_from_args(args)
    document = benchmark(args, endpoint)
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(document, indent=2) + "\n")
    if args.plot_file:  # one point without --sweep-rates
        from mmserve.bench.plots import plot_sweep

        plot_sweep(document["runs"], args.plot_file, f"{endpoint.model}: {args.label or endpoint.base_url}")
    return 0 if all(run["failed"] == 0 for run in document["runs"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmserve bench serve", description=__doc__.split("\n\n")[0])
    add_bench_serve_arguments(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
