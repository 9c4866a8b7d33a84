"""Chaos soak: mixed traffic for a fixed time while preprocess workers are killed, then an audit.

    python tests/reliability/chaos_soak.py [--minutes 10] [--concurrency 32] [--kill-every 20]

`make chaos-soak` runs the full issue-20 version (10 minutes, concurrency 32, a worker
SIGKILLed every 20 s). Starts `mmserve serve` on the tiny Qwen2-VL model with two preprocess
workers and the image cache off (so every image goes to a worker and a kill lands on real
work), then keeps `--concurrency` clients busy with soak.py's mix of text, image, multi-turn,
streamed and sampled requests, a tenth of which the client abandons at a random point.

Checks: no request failed that the client did not abandon (a killed worker's image is retried
on its replacement); kills landed on images in flight; the pool healed (two live workers);
after the traffic, KV blocks, encoder-cache references and running/waiting requests are back
to 0 as at the baseline, the server's and EngineCore's descriptors back to the baseline, the
new workers hold no more than the first ones, and no shared-memory segment is mapped by the
server (nothing cached, nothing in flight; only the pool's bounded spares remain); after
SIGTERM the server exits 0 and leaves no process or segment. Exit status 0 only if all pass.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reliability_util import (
    engine_pid,
    fd_count,
    idle_gauges,
    preprocess_worker_pids,
    segments,
    serve,
    wait_for,
)
from soak import image_urls, request_body, send_one

from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.server import descendants, is_alive

SPARE_BUDGET_BYTES = 256 << 20  # PreprocessPool's default spare_bytes


class WorkerKiller:
    """SIGKILLs a random live preprocess worker every `every_s` seconds (a thread)."""

    def __init__(self, server, every_s: float, seed: int) -> None:
        self.kills: list[dict] = []
        self._server = server
        self._every_s = every_s
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            workers = sorted(preprocess_worker_pids(self._server))
            if not workers:
                continue
            victim = self._rng.choice(workers)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"t_s": round(time.monotonic() - self._started, 1), "pid": victim})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def drive_for(url: str, seconds: float, concurrency: int, seed: int, images: list[str]) -> list[dict]:
    """`concurrency` clients, each sending one request after another until `seconds` pass."""
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    outcomes: list[dict] = []
    async with httpx.AsyncClient(limits=limits) as client:

        async def lane(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                body, plan = request_body(rng, images)
                outcomes.append(await send_one(client, url, body, plan, rng))

        await asyncio.gather(*(lane(i) for i in range(concurrency)))
    return outcomes


def mapped_segments(pid: int) -> set[str]:
    """Preprocess segments the process has mapped (a cached or in-use image)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.rsplit("/", 1)[1] for line in maps.splitlines() if "/mmserve_pp_" in line}


def pool_prefix(server) -> str:
    """The pool's segment prefix, from its start-up log line."""
    for line in server.log_path.read_text(errors="replace").splitlines():
        if "mmserve_pp_" in line:
            start = line.index("mmserve_pp_")
            return line[start:].split()[0].rstrip("*,;)")
    raise AssertionError("the server log names no preprocess segment prefix")


def fds_of(server) -> dict[str, int]:
    named = {"server": fd_count(server.proc.pid), "engine_core": fd_count(engine_pid(server))}
    for i, pid in enumerate(sorted(preprocess_worker_pids(server))):
        named[f"worker_{i}"] = fd_count(pid)
    return named


def audit(server, outcomes: list[dict], killer: WorkerKiller, baseline: dict, prefix: str) -> dict:
    """The checks that need the server running (see the module doc)."""
    gauges_idle = wait_for(lambda: set(idle_gauges(server.url).values()) == {0.0}, 60)
    healed = wait_for(lambda: len(preprocess_worker_pids(server)) == 2, 60)
    time.sleep(2.0)  # closed client sockets reaped
    final_fds = fds_of(server)
    live = segments(prefix)
    live_bytes = sum(os.stat(f"/dev/shm/{name}").st_size for name in live)
    log = server.log_path.read_text(errors="replace")
    errors = [o for o in outcomes if o["error"]]
    worker_base = max(v for k, v in baseline["fds"].items() if k.startswith("worker_"))
    checks = {
        "no_unexpected_errors": not errors,
        "workers_were_killed": len(killer.kills) >= 1,
        "kills_hit_images_in_flight": "retrying it on a new worker" in log,
        "pool_healed": healed,
        "engine_idle_as_at_baseline": gauges_idle and baseline["gauges_idle"],
        "server_and_engine_fds_at_baseline": all(
            final_fds[n] <= baseline["fds"][n] + 2 for n in ("server", "engine_core")
        ),
        "new_workers_fds_at_baseline": all(
            v <= worker_base + 2 for k, v in final_fds.items() if k.startswith("worker_")
        ),
        "no_segment_mapped_when_idle": not mapped_segments(server.proc.pid),
        "spares_within_budget": live_bytes <= SPARE_BUDGET_BYTES,
    }
    return {
        "checks": checks,
        "errors": errors[:20],
        "final_fds": final_fds,
        "segments_idle": {"baseline": baseline["segments"], "final": len(live), "final_bytes": live_bytes},
        "retries_logged": log.count("retrying it on a new worker"),
        "second_deaths_logged": log.count("its second try"),
    }


def run(args: argparse.Namespace) -> dict:
    images = image_urls(random.Random(args.seed))
    server = serve(
        checkpoint("qwen2_vl"),
        "--preprocess-workers",
        "2",
        "--mm-processor-cache-gb",
        "0",
        "--max-num-seqs",
        "32",
        "--kv-cache-memory",
        "64MiB",
        "--max-request-body",
        "16MiB",
        log_path=args.log,
        threads=args.threads,
    )
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "load_before": _load()}
    children: list[int] = []
    prefix = ""
    try:
        server.wait_healthy(300)
        prefix = pool_prefix(server)
        warm = asyncio.run(drive_for(server.url, args.warmup_s, args.concurrency, args.seed, images))
        baseline = {
            "gauges_idle": wait_for(lambda: set(idle_gauges(server.url).values()) == {0.0}, 60),
            "fds": fds_of(server),
            "segments": len(segments(prefix)),
        }
        children = descendants(server.proc.pid)
        killer = WorkerKiller(server, args.kill_every, args.seed)
        started = time.monotonic()
        killer.start()
        try:
            outcomes = asyncio.run(
                drive_for(server.url, args.minutes * 60, args.concurrency, args.seed + 1, images)
            )
        finally:
            killer.stop()
        main_s = time.monotonic() - started
        children = sorted(set(children) | set(descendants(server.proc.pid)))
        report.update(audit(server, warm + outcomes, killer, baseline, prefix))
        kept = sorted(o["latency_s"] for o in outcomes if o["plan"] == "keep" and o["status"] == 200)
        report.update(
            baseline=baseline,
            kills=killer.kills,
            main_phase_s=round(main_s, 1),
            requests=len(outcomes),
            warmup_requests=len(warm),
            completed=sum(o["status"] == 200 for o in outcomes),
            aborted_by_client=sum(o["status"] == "aborted" for o in outcomes),
            throughput_rps=round(len(outcomes) / main_s, 2),
            latency_p50_s=round(kept[len(kept) // 2], 3) if kept else None,
            latency_p99_s=round(kept[int(0.99 * (len(kept) - 1))], 3) if kept else None,
        )
    finally:
        exit_code = server.stop()
    checks = report.setdefault("checks", {})
    checks["sigterm_exit_status_0"] = exit_code == 0
    checks["children_gone"] = wait_for(lambda: not any(is_alive(p) for p in children), 10)
    checks["no_segments_left"] = bool(prefix) and segments(prefix) == []
    report["load_after"] = _load()
    report["passed"] = all(checks.values())
    return report


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the chaos phase")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="traffic before the baseline")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between worker kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in EngineCore")
    parser.add_argument("--out", type=Path, default=Path("chaos-results.json"))
    parser.add_argument("--log", type=Path, default=Path("chaos-server.log"))
    args = parser.parse_args(argv)
    report = run(args)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"chaos soak: {report.get('requests', 0)} requests in {report.get('main_phase_s')} s at "
        f"concurrency {args.concurrency}, {len(report.get('kills', []))} worker kills "
        f"({report.get('retries_logged', 0)} images retried), completed {report.get('completed')}, "
        f"aborted by the client {report.get('aborted_by_client')}, load {report['load_before']} -> "
        f"{report['load_after']}"
    )
    for name, ok in report["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    for error in report.get("errors", [])[:5]:
        print("  error:", error)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
