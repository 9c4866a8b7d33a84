"""Run one workload against several servers, one after another, and write one comparison table.

    python benchmarks/side_by_side.py MODEL_DIR --dataset-path DIR --num-prompts 100 \
        --max-concurrency 8 --output-len 32 --ignore-eos \
        --peer mmserve=mmserve --peer hf=hf --peer vllm=vllm:--dtype bfloat16 \
        --markdown benchmarks/results/x.md --json benchmarks/results/x.json

Every peer gets the same sampled requests (same seed) through `mmserve.bench.serve.benchmark`;
each server is started on loopback, warmed up by --num-warmups requests, measured --rounds times
on disjoint rows of one seeded sample (the round with the median request throughput is reported),
and stopped before the next starts.
Ratios compare peers measured in this same invocation only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

from mmserve.bench.dataset import load_conversations
from mmserve.bench.peers import ROOT, Peer, RunningServer
from mmserve.bench.process_cpu import cpu_between, group_cpu_seconds
from mmserve.bench.serve import add_bench_serve_arguments, benchmark, endpoint_from_args, machine_facts
from mmserve.bench.vllm_client import vllm_round
from mmserve.testing.server import free_port


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--peer", action="append", type=Peer.parse, required=True, help="NAME=KIND[:ARGS]")
    p.add_argument("--rounds", type=int, default=1, help="Measured runs per peer; the median is reported.")
    p.add_argument(
        "--files-peer",
        action="append",
        default=[],
        help="With --multi-turn: peers (by NAME) whose conversations upload their images once to "
        "/v1/files and refer to them by id (--image-refs file); the others send data URLs.",
    )
    p.add_argument("--title", default="", help="Heading of the markdown section.")
    p.add_argument("--markdown", default=None, help="Write the tables here.")
    p.add_argument("--json", default=None, help="Write every run's full result here.")
    p.add_argument("--plot", default=None, help="PNG bar chart of the peers.")
    p.add_argument("--log-dir", default="/tmp/side_by_side", help="Server logs.")
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--client",
        choices=("mmserve", "vllm"),
        default="mmserve",
        help="Load generator: mmserve bench serve (in this process) or vLLM's `vllm bench serve`.",
    )
    add_bench_serve_arguments(p)
    args = p.parse_args(argv)
    unknown = set(args.files_peer) - {peer.name for peer in args.peer}
    if unknown:
        p.error(f"--files-peer names no --peer: {', '.join(sorted(unknown))}")
    if args.files_peer and not (args.multi_turn and args.client == "mmserve"):
        p.error("--files-peer needs --multi-turn and --client mmserve (vLLM's client has no file references)")
    if args.image_refs != "data-url":
        p.error("--image-refs is chosen per peer here: name the peers with --files-peer")
    return args


def run_peer(peer: Peer, args: argparse.Namespace, dataset) -> dict:
    """Start the peer, run the workload --rounds times, stop it; the median round's result."""
    port = free_port()
    argv, env = peer.command(args.model_dir, port, args.vllm_venv)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    server = RunningServer(argv, env, port, Path(args.log_dir) / f"{peer.name}.log")
    try:
        server.wait_healthy(args.startup_timeout)
        bench_args = argparse.Namespace(**vars(args))
        bench_args.base_url, bench_args.model = server.url, None
        bench_args.image_refs = "file" if peer.name in args.files_peer else "data-url"
        endpoint = endpoint_from_args(bench_args)
        rounds, cpu_by_round = [], []
        for i in range(args.rounds):
            print(f"--- {peer.name} ({peer.describe()}), round {i + 1}/{args.rounds}", flush=True)
            # Each round takes the next rows of the same seeded sample (the same for every peer),
            # so no round hits prefix-cache entries an earlier round left behind.
            bench_args.num_warmups = args.num_warmups if i == 0 else 0
            skip = 0 if i == 0 else args.num_warmups + i * args.num_prompts
            cpu_before = group_cpu_seconds(server.proc.pid)
            if args.client == "vllm":
                rounds.append(vllm_round(bench_args, server.url, i))
            else:
                rounds.append(benchmark(bench_args, endpoint, dataset, skip_rows=skip))
            requests = rounds[-1]["num_prompts"] + bench_args.num_warmups
            spent = cpu_between(cpu_before, group_cpu_seconds(server.proc.pid))
            cpu_by_round.append({name: 1000 * s / requests for name, s in spent.items() if s > 0})
        counters = server_counters(server.url) if peer.kind == "mmserve" else {}
    finally:
        server.stop()
    rates = [r["runs"][0]["request_throughput"] for r in rounds]
    median = rates.index(statistics.median_low(rates))
    chosen = rounds[median]
    return chosen | {
        "server_cpu_ms_per_request": cpu_by_round[median],
        "peer": peer.name,
        "server": peer.describe(),
        "rounds_req_per_s": rates,
        "server_counters": counters,
    }


def server_counters(url: str) -> dict[str, float]:
    """mmserve's cache and encoder counters from /metrics, summed over labels, for the whole
    life of the server (warm-ups and every round included)."""
    wanted = (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "mm_cache_queries",
        "mm_cache_hits",
        "encoder_runs",
    )
    totals = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{")[0].split(" ")[0].removeprefix("mmserve:").removesuffix("_total")
        if name in totals and not line.startswith("#"):
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def markdown(results: list[dict], args: argparse.Namespace, command: str) -> str:
    first = results[0]
    facts = machine_facts()
    lines = [
        f"### {args.title or Path(args.model_dir).name}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {facts['cpu_count']} cores; load average (1 min) before each run in the table; "
        f"{first['num_prompts']} {'conversations' if args.multi_turn else 'prompts'}, "
        f"concurrency {args.max_concurrency or 'unlimited'}, rate {args.request_rate:g} req/s, "
        f"{args.output_len} output tokens{' (ignore_eos)' if args.ignore_eos else ''}, "
        f"{args.rounds} round(s) per peer (median shown); client: "
        f"{'vllm bench serve' if args.client == 'vllm' else 'mmserve bench serve'}.",
        "",
        "| peer | server | req/s | out tok/s | TTFT mean / median / P99 (ms) | TPOT median / P99 (ms) "
        "| ITL median (ms) | E2EL median / P99 (ms) | failed | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r["runs"][0]
        lines.append(
            f"| {r['peer']} | `{r['server']}` | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} "
            f"| {m['mean_ttft_ms']:.0f} / {m['median_ttft_ms']:.0f} / {m.get('p99_ttft_ms', 0):.0f} "
            f"| {m['median_tpot_ms']:.1f} / {m.get('p99_tpot_ms', 0):.1f} | {m['median_itl_ms']:.1f} "
            f"| {m['median_e2el_ms']:.0f} / {m.get('p99_e2el_ms', 0):.0f} | {m['failed']} "
            f"| {m['loadavg_1min_before']:.1f} |"
        )
    names = [r["peer"] for r in results]
    lines += ["", "Request throughput ratio, row ÷ column (same invocation):", ""]
    lines += ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in results:
        ratios = [
            r["runs"][0]["request_throughput"] / max(c["runs"][0]["request_throughput"], 1e-9)
            for c in results
        ]
        lines.append(f"| {r['peer']} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    lines += [
        "",
        "Server CPU per request (ms of user + system time, the round's warm-ups included), by process:",
        "",
        "| peer | total | by process |",
        "|---|---:|---|",
    ]
    for r in results:
        cpu = r.get("server_cpu_ms_per_request", {})
        parts = ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(cpu.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['peer']} | {sum(cpu.values()):.1f} | {parts} |")
    counted = [r for r in results if r["server_counters"]]
    if counted:
        names = list(counted[0]["server_counters"])
        lines += ["", "mmserve's /metrics counters over the server's life (warm-ups and all rounds):", ""]
        lines += ["| peer | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for r in counted:
            lines.append(
                f"| {r['peer']} | " + " | ".join(f"{r['server_counters'][n]:.0f}" for n in names) + " |"
            )
    if args.multi_turn:
        lines += ["", "Median TTFT (ms) by turn:", ""]
        turns = sorted({t for r in results for t in r["runs"][0]["ttft_by_turn"]}, key=int)
        lines += ["| peer | " + " | ".join(f"turn {t}" for t in turns) + " |", "|---|" + "---:|" * len(turns)]
        for r in results:
            by_turn = r["runs"][0]["ttft_by_turn"]
            cells = [f"{by_turn[t]['median_ms']:.0f}" if t in by_turn else "–" for t in turns]
            lines.append(f"| {r['peer']} | " + " | ".join(cells) + " |")
        lines += ["", "Median request bytes by turn:", ""]
        lines += ["| peer | " + " | ".join(f"turn {t}" for t in turns) + " |", "|---|" + "---:|" * len(turns)]
        for r in results:
            sizes = r["runs"][0].get("request_bytes_by_turn", {})
            cells = [f"{sizes[t]:.0f}" if t in sizes else "–" for t in turns]
            lines.append(f"| {r['peer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/side_by_side.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    dataset = load_conversations(args.dataset_path, args.dataset_split)
    results = []
    for peer in args.peer:
        try:
            results.append(run_peer(peer, args, dataset))
        except (RuntimeError, TimeoutError) as e:
            print(f"peer {peer.name} failed: {e}", file=sys.stderr)
    if not results:
        return 1
    text = markdown(results, args, command)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if args.json:
        document = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        from mmserve.bench.plots import plot_peers

        plot_peers(results, args.plot, args.title or os.path.basename(args.model_dir))
    return 0 if all(r["runs"][0]["failed"] == 0 for r in results) and len(results) == len(args.peer) else 1
