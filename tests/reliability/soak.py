"""Soak: thousands of mixed requests against one server, then an audit of what it holds.

    python tests/reliability/soak.py [--requests 2000] [--concurrency 32] [--max-minutes 10]

Starts `mmserve serve` on the tiny Qwen2-VL model and sends text, 1-3 image, multi-turn,
streaming and non-streaming chat requests (greedy and sampled), a share of which the client
abandons at a random point. Then checks: no unexpected error; every process's RSS (server,
EngineCore, preprocess workers) grew less than 5% from the end of warm-up to the end; no
leaked file descriptors; the engine idle (no KV block, encoder reference, running or waiting
request); and, after the server stops, none of its shared-memory segments left.
Prints a report and writes it as JSON (--out). Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import statistics
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
    rss_kib,
    segment_prefix,
    segments,
    serve,
    wait_for,
)

from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import png_bytes, synthetic_image
from mmserve.testing.server import descendants, is_alive

CHAT = "/v1/chat/completions"
NUM_IMAGES = 24  # distinct images: all seen during warm-up, so caches stop growing there
WORDS = "river stone light harbour cloud engine paper garden signal winter orbit copper".split()


def image_urls(rng: random.Random) -> list[str]:
    urls = []
    for i in range(NUM_IMAGES):
        image = synthetic_image(rng.randint(40, 400), rng.randint(40, 300), seed=i)
        urls.append("data:image/png;base64," + base64.b64encode(png_bytes(image)).decode())
    return urls


def request_body(rng: random.Random, images: list[str]) -> tuple[dict, str]:
    """A random chat request and how the client will treat it ("keep", "abort")."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    content: list[dict] | str = text
    if rng.random() < 0.6:
        picks = rng.sample(images, rng.randint(1, 3))
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in picks]
        content = [*parts, {"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    if rng.random() < 0.3:  # multi-turn: an earlier exchange (maybe with an image) first
        earlier = {"type": "image_url", "image_url": {"url": rng.choice(images)}}
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [earlier, {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": "A picture."},
            *messages,
        ]
    body = {
        "messages": messages,
        "max_tokens": rng.randint(1, 40),
        "stream": rng.random() < 0.5,
        "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]),
    }
    if rng.random() < 0.2:
        body["stream_options"] = {"include_usage": True} if body["stream"] else None
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["n"] = 2
    return body, ("abort" if rng.random() < 0.1 else "keep")


async def send_one(c: httpx.AsyncClient, url: str, body: dict, plan: str, rng: random.Random) -> dict:
    start = time.monotonic()
    outcome = {"plan": plan, "stream": body["stream"], "error": None}
    try:
        if plan == "abort":
            if body["stream"]:
                async with c.stream("POST", url + CHAT, json=body, timeout=60) as r:
                    wanted = rng.randint(0, 5)
                    async for line in r.aiter_lines():
                        wanted -= line.startswith("data: {")
                        if wanted < 0:
                            break
            else:
                await c.post(url + CHAT, json=body, timeout=rng.uniform(0.005, 0.5))
            outcome["status"] = "aborted"
        elif body["stream"]:
            async with c.stream("POST", url + CHAT, json=body, timeout=120) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            error_events = [e for e in events if "error" in e]
            if r.status_code != 200 or error_events or not lines or lines[-1] != "data: [DONE]":
                outcome["error"] = f"{r.status_code}: {(error_events or lines[-1:])!r}"[:500]
            outcome["status"] = r.status_code
        else:
            r = await c.post(url + CHAT, json=body, timeout=120)
            if r.status_code != 200:
                outcome["error"] = f"{r.status_code}: {r.text[:300]}"
            outcome["status"] = r.status_code
    except httpx.TimeoutException:
        outcome["status"] = "aborted" if plan == "abort" else "timeout"
        if plan != "abort":
            outcome["error"] = "client timeout (120 s)"
    except httpx.HTTPError as e:
        outcome["status"] = "transport"
        outcome["error"] = f"{type(e).__name__}: {e}"
    outcome["latency_s"] = time.monotonic() - start
    return outcome


async def _drive(
    url: str, bodies: list[tuple[dict, str]], concurrency: int, seed: int, deadline: float
) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as c:

        async def run(body: dict, plan: str, task_rng: random.Random) -> dict:
            async with gate:
                if time.monotonic() > deadline:
                    return {"plan": plan, "status": "skipped", "error": None, "latency_s": 0.0}
                return await send_one(c, url, body, plan, task_rng)

        return await asyncio.gather(*(run(b, p, random.Random(rng.random())) for b, p in bodies))


def _processes(server) -> dict[str, int]:
    named = {"server": server.proc.pid, "engine_core": engine_pid(server)}
    for i, pid in enumerate(sorted(preprocess_worker_pids(server))):
        named[f"preprocess_worker_{i}"] = pid
    return named


def _snapshot(pids: dict[str, int]) -> dict[str, dict[str, int]]:
    return {name: {"pid": pid, **memory(pid), "fds": fd_count(pid)} for name, pid in pids.items()}


def memory(pid: int) -> dict[str, int]:
    """VmRSS and its parts (anonymous, file-backed, shared memory), KiB."""
    fields = {"VmRSS": "rss_kib", "RssAnon": "anon_kib", "RssFile": "file_kib", "RssShmem": "shmem_kib"}
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in fields:
            found[fields[key]] = int(line.split()[1])
    return found


class _Sampler:
    """RSS of every process every 5 s while the main phase runs (MiB), to show the trend."""

    def __init__(self, pids: dict[str, int], started: float) -> None:
        self.samples: list[dict] = []
        self._pids = pids
        self._started = started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            sample = {"t_s": round(time.monotonic() - self._started, 1)}
            sample.update({name: round(rss_kib(pid) / 1024, 1) for name, pid in self._pids.items()})
            self.samples.append(sample)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--warmup", type=int, default=1000, help="requests before the baseline snapshot (see RELIABILITY.md)"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-minutes", type=float, default=10.0, help="stop sending after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in EngineCore")
    parser.add_argument("--out", type=Path, default=Path("soak-results.json"))
    parser.add_argument("--log", type=Path, default=Path("soak-server.log"))
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    images = image_urls(rng)
    bodies = [request_body(rng, images) for _ in range(args.requests)]
    started = time.monotonic()
    deadline = started + args.max_minutes * 60
    load_before = os.getloadavg()
    server = serve(
        checkpoint("qwen2_vl"),
        "--preprocess-workers",
        "2",
        "--max-num-seqs",
        "32",
        "--kv-cache-memory",
        "64MiB",  # small enough to be fully touched (and reused) during warm-up
        "--max-request-body",
        "16MiB",
        log_path=args.log,
        threads=args.threads,
    )
    checks: dict[str, bool] = {}
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        server.wait_healthy(300)
        pids = _processes(server)
        children = descendants(server.proc.pid)
        warm = asyncio.run(_drive(server.url, bodies[: args.warmup], args.concurrency, args.seed, deadline))
        prefix = segment_prefix(server)
        wait_for(lambda: set(idle_gauges(server.url).values()) == {0.0}, 30)
        baseline = _snapshot(pids)
        main_start = time.monotonic()
        sampler = _Sampler(pids, started)
        rest = bodies[args.warmup :]
        half = len(rest) // 2
        main_start = time.monotonic()
        outcomes = asyncio.run(_drive(server.url, rest[:half], args.concurrency, args.seed + 1, deadline))
        wait_for(lambda: set(idle_gauges(server.url).values()) == {0.0}, 30)
        midway = _snapshot(pids)
        outcomes += asyncio.run(_drive(server.url, rest[half:], args.concurrency, args.seed + 2, deadline))
        main_s = time.monotonic() - main_start
        sampler.stop()
        gauges_idle = wait_for(lambda: set(idle_gauges(server.url).values()) == {0.0}, 30)
        time.sleep(2.0)  # let closed sockets be reaped
        final = _snapshot(pids)
        all_outcomes = warm + outcomes
        errors = [o for o in all_outcomes if o["error"]]
        kept = [o for o in outcomes if o["plan"] == "keep" and o["status"] == 200]
        latencies = sorted(o["latency_s"] for o in kept)

        growth = {
            name: (final[name]["rss_kib"] - baseline[name]["rss_kib"]) / max(1, baseline[name]["rss_kib"])
            for name in pids
        }
        second_half_growth = {
            name: (final[name]["rss_kib"] - midway[name]["rss_kib"]) / max(1, midway[name]["rss_kib"])
            for name in pids
        }
        fd_growth = {name: final[name]["fds"] - baseline[name]["fds"] for name in pids}
        live_segments = len(segments(prefix))
        checks["no_unexpected_errors"] = not errors
        checks["all_requests_sent"] = not any(o["status"] == "skipped" for o in all_outcomes)
        checks["engine_idle_after"] = gauges_idle
        checks["rss_growth_under_5_percent"] = all(g < 0.05 for g in growth.values())
        checks["no_fd_leak"] = all(fd_growth[n] <= 2 for n in pids)  # a cached image holds none
        report.update(
            requests=len(all_outcomes),
            warmup_requests=len(warm),
            aborted_by_client=sum(o["status"] == "aborted" for o in all_outcomes),
            completed=sum(o["status"] == 200 for o in all_outcomes),
            errors=errors[:20],
            num_errors=len(errors),
            main_phase_s=round(main_s, 1),
            throughput_rps=round(len(outcomes) / main_s, 1),
            latency_s={
                "p50": round(statistics.median(latencies), 3) if latencies else None,
                "p99": round(latencies[int(0.99 * (len(latencies) - 1))], 3) if latencies else None,
            },
            baseline=baseline,
            midway=midway,
            final=final,
            rss_growth_second_half_percent={k: round(100 * v, 2) for k, v in second_half_growth.items()},
            rss_growth_percent={k: round(100 * v, 2) for k, v in growth.items()},
            rss_mib_over_time=sampler.samples,
            fd_growth=fd_growth,
            live_segments_before_stop=live_segments,
            gauges_after=idle_gauges(server.url),
        )
    finally:
        exit_code = server.stop()
    checks["server_stopped_cleanly"] = exit_code == 0  # SIGTERM drains, then exits 0
    checks["children_gone"] = wait_for(lambda: not any(is_alive(p) for p in children), 10)
    checks["no_shm_segments_left"] = segments(prefix) == []
    report.update(
        checks=checks,
        passed=all(checks.values()),
        wall_s=round(time.monotonic() - started, 1),
        load_average_before=[round(x, 2) for x in load_before],
        load_average_after=[round(x, 2) for x in os.getloadavg()],
        machine={"cpus": os.cpu_count(), "python": platform.python_version()},
    )
    args.out.write_text(json.dumps(report, indent=2))
    _print(report)
    return 0 if report["passed"] else 1


def _print(report: dict) -> None:
    load = report["load_average_before"]
    print(f"soak: {report['requests']} requests in {report['wall_s']} s (load average before: {load})")
    print(
        f"  completed {report['completed']}, aborted by the client {report['aborted_by_client']}, "
        f"unexpected errors {report['num_errors']}"
    )
    print(
        f"  throughput {report['throughput_rps']} req/s, latency p50 {report['latency_s']['p50']} s, "
        f"p99 {report['latency_s']['p99']} s"
    )
    for name, base in report["baseline"].items():
        mid, end = report["midway"][name], report["final"][name]
        print(
            f"  {name:20s} RSS {base['rss_kib'] / 1024:6.1f} -> {mid['rss_kib'] / 1024:6.1f} -> "
            f"{end['rss_kib'] / 1024:6.1f} MiB ({report['rss_growth_percent'][name]:+.2f}%; second half "
            f"{report['rss_growth_second_half_percent'][name]:+.2f}%), fds {base['fds']} -> {end['fds']}"
        )
    for name, ok in report["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    for error in report["errors"][:5]:
        print("  error:", error)


if __name__ == "__main__":
    sys.exit(main())
