"""The least time any exact engine needs for a serving benchmark's work on this machine.

    .venv/bin/python -m benchmarks.compute_floor $MID --dataset-path /tmp/visionarena \
        --num-prompts 32 --max-concurrency 8 --output-len 32 --measured vllm-tuned=266 --measured mmserve=277

A Qwen2-VL request's prefill is arithmetic the model fixes: every vision layer's matmuls over
the image's patches and its attention over all of them (full attention in Qwen2-VL), the
merger, and the language model's matmuls and causal attention over the prompt. This samples the
rows `vllm bench serve` sends (VisionArena: the dataset shuffled with the seed, each row's first
user message and first image), sizes each image as the processor does, counts those FLOPs, and
divides them by the fastest rate this process measures for the same kinds of work in `--dtype`
(a large matmul, the vision MLP's matmuls through oneDNN's packed weight and csrc's panels, and
attention over one image's patches through SDPA and csrc's varlen kernel, with the same
threads). Decoding adds, per step of `--max-concurrency` requests, the weights' bytes ÷ a
read-only STREAM bandwidth.

The result is a floor, not an estimate of either engine: it assumes every FLOP at the best rate
measured and no other cost (no preprocessing, scheduling, norms, activations, or idle cores).
`--measured NAME=SECONDS` (a benchmark duration of the same rows) prints duration ÷ floor, and
the most any engine could then be faster than that peer: peer duration ÷ floor.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from mmserve.bench.dataset import load_conversations
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.ops import cpu
from mmserve.ops.linear import OneDnnLinear, onednn_supports
from preprocess.qwen_vl import QwenVLImageSettings


@dataclass(frozen=True)
class Shapes:
    """The dimensions the FLOP count needs, from a Qwen2-VL config.json."""

    vision_dim: int
    vision_depth: int
    vision_mlp: int
    merge: int
    patch_dim: int  # in_chans · temporal_patch_size · patch_size²
    hidden: int
    intermediate: int
    layers: int
    head_dim: int
    kv_dim: int  # kv heads · head_dim
    vocab: int

    @classmethod
    def from_config(cls, config: dict) -> Shapes:
        if config.get("model_type") != "qwen2_vl":
            raise SystemExit(
                f"compute_floor counts Qwen2-VL's full-attention tower; got {config.get('model_type')}"
            )
        vision = config["vision_config"]
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        return cls(
            vision_dim=vision["embed_dim"],
            vision_depth=vision["depth"],
            vision_mlp=vision["embed_dim"] * vision["mlp_ratio"],
            merge=vision["spatial_merge_size"],
            patch_dim=vision["in_chans"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2,
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            head_dim=head_dim,
            kv_dim=config["num_key_value_heads"] * head_dim,
            vocab=config["vocab_size"],
        )


def vision_flops(s: Shapes, patches: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of one image of `patches` patches through the tower."""
    d = s.vision_dim
    per_layer = 2 * patches * (d * 3 * d + d * d + 2 * d * s.vision_mlp)  # qkv, proj, fc1, fc2
    merged = patches // s.merge**2
    wide = d * s.merge**2
    matmul = (
        2 * patches * s.patch_dim * d
        + s.vision_depth * per_layer
        + 2 * merged * (wide * wide + wide * s.hidden)
    )
    attention = s.vision_depth * 4 * patches**2 * d  # QKᵀ and PV over all heads
    return float(matmul), float(attention)


def language_weights(s: Shapes) -> int:
    """Parameters a token's pass multiplies by (embedding lookup excluded, LM head included)."""
    h = s.hidden
    per_layer = h * h + 2 * h * s.kv_dim + h * h + 3 * h * s.intermediate
    return s.layers * per_layer + h * s.vocab


def prefill_flops(s: Shapes, tokens: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of a prompt's prefill; the LM head runs on its last token."""
    per_token = language_weights(s) - s.hidden * s.vocab
    matmul = 2 * tokens * per_token + 2 * s.hidden * s.vocab
    attention = s.layers * 2 * tokens**2 * s.hidden  # causal: half of QKᵀ and PV
    return float(matmul), float(attention)


def sampled_rows(dataset_path: str, num: int, seed: int) -> list[dict]:
    """The rows vLLM's VisionArena sampler sends: the set shuffled with `seed`, the first `num`."""
    dataset = load_conversations(dataset_path).shuffle(seed=seed)
    return [dataset[i] for i in range(min(num, len(dataset)))]


def prompt_tokens(tokenizer: Tokenizer, text: str, image_tokens: int) -> int:
    """Tokens of the chat-templated message `vllm bench serve` sends (text part, then the image),
    rendered as the server renders it, the image's placeholders included."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": ""}}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return len(tokenizer.encode(rendered)) - 1 + image_tokens  # one <|image_pad|> stands for them all


def timed_rate(flops: float, run, rounds: int = 5) -> float:
    """FLOP/s of `run` (median of `rounds` after one warm-up)."""
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return flops / statistics.median(times)


def machine_rates(s: Shapes, patches: int, dtype: torch.dtype) -> dict[str, float]:
    """The best rates this process reaches for the tower's kinds of work in `dtype` (FLOP/s: a
    large matmul, the vision MLP's matmuls through every method the engine can pick, attention
    over the largest image's patches), and a read-only bandwidth (bytes/s)."""
    rates = {}
    a, b = torch.randn(4096, 4096, dtype=dtype), torch.randn(4096, 4096, dtype=dtype)
    rates[f"matmul 4096³ ({dtype})"] = timed_rate(2 * 4096**3, lambda: a @ b, rounds=3)
    x = torch.randn(patches, s.vision_dim, dtype=dtype)
    for name, (n, k) in {"fc1": (s.vision_mlp, s.vision_dim), "fc2": (s.vision_dim, s.vision_mlp)}.items():
        weight = torch.randn(n, k, dtype=dtype)
        rows = x if k == s.vision_dim else torch.randn(patches, k, dtype=dtype)
        if onednn_supports(dtype):
            packed = OneDnnLinear(weight)
            rates[f"vision {name} {patches}x{k}x{n} (oneDNN)"] = timed_rate(
                2 * patches * k * n, lambda packed=packed, rows=rows: packed(rows)
            )
        if cpu.is_available() and (dtype == torch.float32 or cpu.bf16_dot_products()):
            panels = cpu.pack_weight(weight)
            rates[f"vision {name} {patches}x{k}x{n} (csrc panels)"] = timed_rate(
                2 * patches * k * n,
                lambda panels=panels, rows=rows, n=n: cpu.packed_linear(rows, panels, None, n),
            )
    heads = s.vision_dim // 64
    q = torch.randn(1, heads, patches, 64, dtype=dtype)
    attention_flops = 4 * patches**2 * heads * 64
    rates[f"SDPA {patches} patches"] = timed_rate(
        attention_flops, lambda: F.scaled_dot_product_attention(q, q, q)
    )
    if cpu.is_available():
        rows = q[0].transpose(0, 1).contiguous()  # [N, H, D]
        rates[f"csrc varlen attention {patches} patches"] = timed_rate(
            attention_flops, lambda: cpu.varlen_attention(rows, rows, rows, [0, patches], 0.125)
        )
    big = torch.ones(1 << 28)  # 1 GiB
    start = time.perf_counter()
    for _ in range(5):
        big.sum()
    rates["read bandwidth"] = 5 * big.numel() * 4 / (time.perf_counter() - start)
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the engines' dtype: rates and weight bytes",
    )
    p.add_argument("--measured", action="append", default=[], metavar="NAME=SECONDS")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    shapes = Shapes.from_config(json.loads((args.checkpoint / "config.json").read_text()))
    settings = QwenVLImageSettings.from_hf_config(
        json.loads((args.checkpoint / "preprocessor_config.json").read_text())
    )
    tokenizer = Tokenizer(args.checkpoint)
    parts = {"vision matmul": 0.0, "vision attention": 0.0, "prefill matmul": 0.0, "prefill attention": 0.0}
    total_tokens, largest = 0, 0
    for row in sampled_rows(args.dataset_path, args.num_prompts, args.seed):
        image = row["images"][0]
        if isinstance(image, dict):  # undecoded {bytes, path}
            image = Image.open(io.BytesIO(image["bytes"]))
        grid = settings.grid(image.height, image.width)
        patches = math.prod(grid)
        largest = max(largest, patches)
        tokens = prompt_tokens(tokenizer, row["conversation"][0][0]["content"], settings.num_tokens(grid))
        total_tokens += tokens
        for key, value in zip(
            ("vision matmul", "vision attention"), vision_flops(shapes, patches), strict=True
        ):
            parts[key] += value
        for key, value in zip(
            ("prefill matmul", "prefill attention"), prefill_flops(shapes, tokens), strict=True
        ):
            parts[key] += value

    dtype = getattr(torch, args.dtype)
    rates = machine_rates(shapes, largest, dtype)
    bandwidth = rates.pop("read bandwidth")
    best = max(rates.values())
    steps = math.ceil(args.num_prompts / args.max_concurrency) * args.output_len
    decode_s = steps * language_weights(shapes) * dtype.itemsize / bandwidth
    compute_s = sum(parts.values()) / best
    floor_s = compute_s + decode_s

    print(
        f"{args.num_prompts} rows, {total_tokens} prompt tokens (images included), "
        f"largest image {largest} patches"
    )
    for name, flops in parts.items():
        print(f"  {name:18s} {flops / 1e12:7.2f} TFLOP")
    for name, rate in rates.items():
        print(f"  rate: {name:34s} {rate / 1e9:6.1f} GFLOP/s")
    print(
        f"  read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"decode: {steps} steps x {args.dtype} weights = {decode_s:.1f} s"
    )
    print(
        f"floor: {compute_s:.1f} s of FLOPs at {best / 1e9:.1f} GFLOP/s "
        f"+ {decode_s:.1f} s decode = {floor_s:.1f} s"
    )
    measured = {}
    for item in args.measured:
        name, seconds = item.split("=")
        measured[name] = float(seconds)
        print(
            f"  {name}: {float(seconds):.0f} s = {float(seconds) / floor_s:.2f}x the floor; "
            f"no exact engine can be more than {float(seconds) / floor_s:.2f}x faster than it here"
        )
    if args.json:
        report = {
            "parts_flops": parts,
            "rates": rates,
            "read_bandwidth": bandwidth,
            "prompt_tokens": total_tokens,
            "floor_s": floor_s,
            "decode_s": decode_s,
            "measured_s": measured,
            "threads": args.threads,
            "dtype": args.dtype,
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
