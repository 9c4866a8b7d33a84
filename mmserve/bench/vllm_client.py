"""One benchmark round driven by vLLM's own client, `vllm bench serve`, against any server.

With `side_by_side.py --client vllm` every peer (mmserve, vLLM, transformers) is measured by
the same third-party client on the same VisionArena-format rows: vLLM's VisionArena sampler
(first user turn + first image, text first) over the local parquet stand-in, passed with
`--hf-name lmarena-ai/VisionArena-Chat` so vLLM treats it as that dataset. Its result JSON is
mapped onto the `runs[0]` record `mmserve bench serve` writes, so the tables are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import httpx

PERCENTILES = "50,99"


def served_model(base_url: str) -> str:
    return httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]


def vllm_bench_command(args: argparse.Namespace, base_url: str, seed: int, result: Path) -> list[str]:
    return [
        str(args.vllm_venv / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        base_url,
        "--model",
        served_model(base_url),
        "--tokenizer",
        str(args.model_dir),
        "--dataset-name",
        "hf",
        "--hf-name",
        "lmarena-ai/VisionArena-Chat",
        "--dataset-path",
        str(args.dataset_path),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--hf-output-len",
        str(args.output_len),
        *(["--ignore-eos"] if args.ignore_eos else []),
        "--num-warmups",
        str(args.num_warmups),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        PERCENTILES,
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]


def vllm_round(args: argparse.Namespace, base_url: str, round_index: int) -> dict:
    """Run `vllm bench serve` once (seed + round: a disjoint sample per round, the same for every
    peer) and return its metrics as a `mmserve bench serve` result document."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        result = Path(tmp) / "result.json"
        command = vllm_bench_command(args, base_url, args.seed + round_index, result)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run(command, check=True, env=env)
        raw = json.loads(result.read_text())
    run = {
        "request_rate": float("inf"),
        "loadavg_1min_before": load_before,
        "failed": raw["num_prompts"] - raw["completed"],
        "client": "vllm bench serve",
    }
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"):
        run[key] = raw[key]
    for key in ("median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms", "p99_e2el_ms"):
        run[key] = raw[key]
    return {"num_prompts": raw["num_prompts"], "runs": [run], "vllm_result": raw}
