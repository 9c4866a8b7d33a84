"""Multi-turn image chats replayed as chat UIs send them: every turn resends the whole history,
its images as data URLs (or, for a `--files-peer`, as ids of images uploaded once to /v1/files).

    .venv/bin/python -m benchmarks.multi_turn_images --preset mid --conversations 6 \
        --peer 'cache-on=mmserve:--dtype bfloat16' \
        --peer 'cache-off=mmserve:--dtype bfloat16 --no-enable-prefix-caching' \
        --peer 'files=mmserve:--dtype bfloat16' --files-peer files \
        --peer 'vllm=vllm:--dtype bfloat16' --json benchmarks/results/multi_turn_images.json

Each conversation has `--turns` user turns and two photos (one in turn 1, one in turn 2);
conversations run one at a time (a chat UI's user waits for each answer), each server in turn
on loopback with the same conversations. Reported per turn: median time to first token, median
request bytes and median CPU time of the API server process itself (its own utime + stime from
/proc, not its children's: EngineCore and the preprocess workers are other processes). Ratios
compare peers of the same invocation only.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from mmserve.bench.client import Endpoint, chat_body, send_chat
from mmserve.bench.peers import Peer, RunningServer
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import synthetic_image
from mmserve.testing.server import free_port

QUESTIONS = [
    "What is in this picture?",
    "And in this one?",
    "Which of the two is brighter?",
    "Summarise both.",
]


def jpeg(seed: int, size: tuple[int, int]) -> bytes:
    import io

    buffer = io.BytesIO()
    synthetic_image(*size, seed=seed).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def conversation_images(index: int, size: tuple[int, int]) -> list[bytes]:
    return [jpeg(1000 * index + k, size) for k in range(2)]


def image_part(data: bytes | str) -> dict:
    if isinstance(data, str):  # a file id
        return {"type": "image_file", "image_file": {"file_id": data}}
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(data).decode()},
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` alone (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def replay(
    endpoint: Endpoint, images: list[list[bytes]], args: argparse.Namespace, files: bool, server_pid: int
) -> list[dict]:
    """Every turn of every conversation, one after another: [{turn, ttft_s, request_bytes, api_cpu_s}]."""
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        for pictures in images:
            refs: list[bytes | str] = list(pictures)
            if files:
                refs = [await upload(client, endpoint, data) for data in pictures]
            history: list[dict] = []
            for turn in range(args.turns):
                content = [image_part(refs[turn])] if turn < len(refs) else []
                history.append(
                    {"role": "user", "content": [*content, {"type": "text", "text": QUESTIONS[turn % 4]}]}
                )
                body = chat_body(endpoint.model, history, args.output_len, ignore_eos=True)
                cpu_before = process_cpu_s(server_pid)
                result = await send_chat(client, endpoint, body, turn=turn)
                api_cpu_s = process_cpu_s(server_pid) - cpu_before
                if not result.success:
                    raise RuntimeError(f"turn {turn + 1} failed: {result.error}")
                size = len(json.dumps(body))
                rows.append(
                    {"turn": turn + 1, "ttft_s": result.ttft_s, "request_bytes": size, "api_cpu_s": api_cpu_s}
                )
                history.append({"role": "assistant", "content": result.generated_text})
    return rows


async def upload(client: httpx.AsyncClient, endpoint: Endpoint, data: bytes) -> str:
    files = {"file": ("photo.jpg", data, "image/jpeg")}
    response = await client.post(endpoint.base_url + "/v1/files", files=files, data={"purpose": "vision"})
    response.raise_for_status()
    return response.json()["id"]


def summarise(rows: list[dict], turns: int) -> dict:
    per_turn = {}
    for turn in range(1, turns + 1):
        mine = [r for r in rows if r["turn"] == turn]
        per_turn[turn] = {
            "ttft_median_ms": 1000 * statistics.median(r["ttft_s"] for r in mine),
            "request_bytes_median": statistics.median(r["request_bytes"] for r in mine),
            "api_cpu_median_ms": 1000 * statistics.median(r["api_cpu_s"] for r in mine),
        }
    later = [r["ttft_s"] for r in rows if r["turn"] >= 2]
    return {"per_turn": per_turn, "ttft_turns_2_plus_median_ms": 1000 * statistics.median(later)}


def run_peer(peer: Peer, model_dir: str, images, args: argparse.Namespace) -> dict:
    port = free_port()
    argv, env = peer.command(model_dir, port, Path(args.vllm_venv))
    server = RunningServer(argv, env, port, Path(args.log_dir) / f"{peer.name}.log")
    try:
        server.wait_healthy(args.startup_timeout)
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        endpoint = Endpoint(server.url, model)
        files = peer.name in args.files_peer
        asyncio.run(replay(endpoint, images[:1], args, files, server.proc.pid))  # warm-up, not counted
        rows = asyncio.run(replay(endpoint, images[1:], args, files, server.proc.pid))
    finally:
        server.stop()
    return {
        "peer": peer.name,
        "server": peer.describe(),
        "files": files,
        **summarise(rows, args.turns),
        "rows": rows,
    }


def markdown(results: list[dict], args: argparse.Namespace, load: str) -> str:
    header = "| peer | " + " | ".join(
        f"turn {t}: TTFT ms / bytes / API CPU ms" for t in range(1, args.turns + 1)
    )
    lines = [header + " | turns ≥ 2 median TTFT ms |", "|---" * (args.turns + 2) + "|"]
    for r in results:
        cells = [
            f"{c['ttft_median_ms']:.0f} / {c['request_bytes_median']:.0f} / {c['api_cpu_median_ms']:.1f}"
            for c in r["per_turn"].values()
        ]
        lines.append(f"| {r['peer']} | " + " | ".join(cells) + f" | {r['ttft_turns_2_plus_median_ms']:.0f} |")
    return "\n".join([f"Load before the run: `{load}`", "", *lines])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen2_vl")
    p.add_argument("--preset", default="mid")
    p.add_argument("--conversations", type=int, default=6, help="Measured (one more warms up).")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--image-size", type=int, nargs=2, default=(640, 480))
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--peer", action="append", type=Peer.parse, required=True)
    p.add_argument("--files-peer", action="append", default=[], help="Peers that refer to uploaded files.")
    p.add_argument("--vllm-venv", default="/work/main/.venv-vllm")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    model_dir = str(checkpoint(args.family, args.preset))
    images = [conversation_images(i, tuple(args.image_size)) for i in range(args.conversations + 1)]
    load = Path("/proc/loadavg").read_text().strip() if os.path.exists("/proc/loadavg") else "?"
    results = []
    for peer in args.peer:
        results.append(run_peer(peer, model_dir, images, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
    text = markdown(results, args, load)
    print(text)
    if args.json:
        document = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load": load}
        Path(args.json).write_text(json.dumps({**document, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
