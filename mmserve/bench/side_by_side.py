"""Run one workload against several servers, one after another, and write one comparison table.

    python benchmarks/side_by_side.py MODEL_DIR --dataset-path DIR --num-prompts 100 \
        --max-concurrency 8 --output-len 32 --ignore-eos \
        --peer mmserve=mmserve --peer hf=hf --peer vllm=vllm:--dtype bfloat16 \
        --markdown benchmarks/results/x.md --json benchmarks/results/x.json

Every peer gets the same sampled requests (same seed) through `mmserve.bench.serve.benchmark`;
each server is started on loopback, warmed up by --num-warmups requests, measured --rounds times
on disjoint rows of one seeded sample (the round with the median request throughput is reported),
and stopped before the next starts. With --interleave the rounds go round-robin instead: round i
starts, warms up and measures every peer in turn on round i's rows, so a machine whose speed
drifts over minutes (a shared host) moves every peer of a round alike; the ratios reported are
then the medians of the within-round ratios.
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
        "--interleave",
        action="store_true",
        help="Run the rounds round-robin over the peers (a fresh, warmed-up server per round) and "
        "report the median within-round ratios.",
    )
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


def run_rounds(peer: Peer, args: argparse.Namespace, dataset, indices: list[int]) -> tuple[list[dict], dict]:
    """Start the peer, warm it up, run the rounds `indices` (each on its own rows of the seeded
    sample, the same rows for every peer), stop it; each round's result with its server CPU per
    request, and the server's /metrics counters."""
    port = free_port()
    argv, env = peer.command(args.model_dir, port, args.vllm_venv)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    server = RunningServer(argv, env, port, Path(args.log_dir) / f"{peer.name}.log")
    records = []
    try:
        server.wait_healthy(args.startup_timeout)
        bench_args = argparse.Namespace(**vars(args))
        bench_args.base_url, bench_args.model = server.url, None
        bench_args.image_refs = "file" if peer.name in args.files_peer else "data-url"
        endpoint = endpoint_from_args(bench_args)
        for n, i in enumerate(indices):
            print(f"--- {peer.name} ({peer.describe()}), round {i + 1}/{args.rounds}", flush=True)
            # Round i measures rows [W + i·P, W + (i + 1)·P) of the sample (W warm-ups, P prompts),
            # whether or not it warms up first: no round hits prefix-cache entries an earlier
            # round left behind, and every peer's round i sees the same rows.
            bench_args.num_warmups = args.num_warmups if n == 0 else 0
            skip = i * args.num_prompts + (args.num_warmups - bench_args.num_warmups)
            cpu_before = group_cpu_seconds(server.proc.pid)
            if args.client == "vllm":
                result = vllm_round(bench_args, server.url, i)
            else:
                result = benchmark(bench_args, endpoint, dataset, skip_rows=skip)
            requests = result["num_prompts"] + bench_args.num_warmups
            spent = cpu_between(cpu_before, group_cpu_seconds(server.proc.pid))
            cpu = {name: 1000 * s / requests for name, s in spent.items() if s > 0}
            records.append(result | {"server_cpu_ms_per_request": cpu})
        counters = server_counters(server.url) if peer.kind == "mmserve" else {}
    finally:
        server.stop()
    return records, counters


def summarise(peer: Peer, records: list[dict], counters: dict) -> dict:
    """The round with the median request throughput, with every round's throughput in order."""
    rates = [r["runs"][0]["request_throughput"] for r in records]
    chosen = records[rates.index(statistics.median_low(rates))]
    return chosen | {
        "peer": peer.name,
        "server": peer.describe(),
        "rounds_req_per_s": rates,
        "server_counters": counters,
    }


def within_round_ratios(results: list[dict]) -> list[list[float]]:
    """ratios[a][b]: the median over rounds of peer a's request throughput ÷ peer b's in the same
    round (the peers' rounds_req_per_s in round order)."""
    return [
        [
            statistics.median(
                x / max(y, 1e-9) for x, y in zip(a["rounds_req_per_s"], b["rounds_req_per_s"], strict=True)
            )
            for b in results
        ]
        for a in results
    ]


def add_counters(total: dict, more: dict) -> dict:
    return {name: total.get(name, 0.0) + value for name, value in more.items()}


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
        f"{args.rounds} round(s) per peer{', interleaved' if args.interleave else ''} (median shown); "
        "client: "
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
    if args.interleave:
        heading = "Request throughput ratio, row ÷ column: median of the within-round ratios (interleaved)"
        table = within_round_ratios(results)
    else:
        heading = "Request throughput ratio, row ÷ column (same invocation)"
        rate = [r["runs"][0]["request_throughput"] for r in results]
        table = [[x / max(y, 1e-9) for y in rate] for x in rate]
    lines += ["", heading + ":", ""]
    lines += ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r, ratios in zip(results, table, strict=True):
        lines.append(f"| {r['peer']} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    if args.interleave:
        lines += ["", "Request throughput by round (req/s):", ""]
        lines += ["| peer | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " |"]
        lines += ["|---|" + "---:|" * args.rounds]
        for r in results:
            lines.append(f"| {r['peer']} | " + " | ".join(f"{x:.2f}" for x in r["rounds_req_per_s"]) + " |")
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
        lines += ["", "mmserve's /metrics counters over the servers' lives (warm-ups and all rounds):", ""]
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
    schedule = (
        [(peer, [i]) for i in range(args.rounds) for peer in args.peer]
        if args.interleave
        else [(peer, list(range(args.rounds))) for peer in args.peer]
    )
    records: dict[str, list[dict]] = {peer.name: [] for peer in args.peer}
    counters: dict[str, dict] = {peer.name: {} for peer in args.peer}
    failed: set[str] = set()
    for peer, indices in schedule:
        if peer.name in failed:
            continue
        try:
            done, more = run_rounds(peer, args, dataset, indices)
        except (RuntimeError, TimeoutError) as e:
            print(f"peer {peer.name} failed: {e}", file=sys.stderr)
            failed.add(peer.name)
            continue
        records[peer.name] += done
        counters[peer.name] = add_counters(counters[peer.name], more)
    results = [summarise(p, records[p.name], counters[p.name]) for p in args.peer if p.name not in failed]
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
