"""The C++ CPU kernels against their torch references and against the engine's current paths.

Run from the repository root:

    .venv/bin/python -m benchmarks.kernels_cpu [--threads 1 2] [--rounds 15] [--json PATH]
        [--mid-decode-only]

For each case every candidate runs in the same process, interleaved round by round (so a
neighbour's burst hits all of them alike), and the median of the rounds is reported with the
ratios to the kernel. Attention uses Qwen2-VL-2B's shapes (12 query heads, 2 kv heads,
head_dim 128, block size 16) in float32: decode at batch 1/8/32 with contexts 256–2048 against
TorchAttentionBackend (both sides also write the step's k/v) and the ops reference, and a
512-token prefill chunk against the backend and against SDPA on contiguous tensors; then the
mid test model's shapes (12 query heads, 4 kv heads, head_dim 64) decoding at batch 1/8 in
float32 and bfloat16. Decode attention's achieved bandwidth (bytes of K/V read ÷ time) is
printed next to a STREAM-style copy and a read-only sum measured in the same run with the same
threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from mmserve.layers.activation import SiluAndMul
from mmserve.layers.attention import AttentionMetadata
from mmserve.layers.attention.torch_backend import TorchAttentionBackend
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import MRotaryEmbedding
from mmserve.ops import cpu, reference
from mmserve.ops.sdpa import varlen_attention_sdpa as torch_varlen_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 2, 128, 16
HIDDEN, INTERMEDIATE = 1536, 8960


@dataclass(frozen=True)
class AttentionShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


QWEN2_VL_2B = AttentionShape("2B", HEADS, KV_HEADS, HEAD_DIM)
MID = AttentionShape("mid", 12, 4, 64)  # the mid test model (mmserve.testing.checkpoints)


@dataclass
class Result:
    case: str
    ms: dict[str, float]  # candidate → median milliseconds
    extra: dict[str, float] = field(default_factory=dict)


def time_interleaved(candidates: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each candidate, measured in rotating order round after round."""
    names = list(candidates)
    repeats = {}
    for name, fn in candidates.items():
        fn()  # warm up (and build the kernels on the first call)
        start = time.perf_counter()
        fn()
        repeats[name] = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, n = candidates[name], repeats[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(values) for name, values in samples.items()}


def paged_step(
    query_lens: list[int],
    seq_lens: list[int],
    seed: int = 0,
    shape: AttentionShape = QWEN2_VL_2B,
    dtype: torch.dtype = torch.float32,
):
    """A step's q/k/v, a shuffled paged cache holding each context and its metadata."""
    rng = np.random.default_rng(seed)
    needed = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(needed) + 8
    ids = rng.permutation(num_blocks)
    table = np.zeros((len(seq_lens), max(needed)), dtype=np.int32)
    offset = 0
    for r, n in enumerate(needed):
        table[r, :n] = ids[offset : offset + n]
        offset += n
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    owners = np.repeat(np.arange(len(seq_lens)), query_lens)
    slots = table[owners, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    num_tokens = int(starts[-1])
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=torch.from_numpy(starts).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots),
        query_start_loc_cpu=starts,
        seq_lens_cpu=np.array(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    q = torch.randn(num_tokens, heads, head_dim).to(dtype)
    k, v = (torch.randn(num_tokens, kv_heads, head_dim).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim).to(dtype)
    return q, k, v, cache, meta


def kernel_forward(q, k, v, cache, meta, out):
    cpu.write_kv(k, v, cache, meta.slot_mapping)
    return cpu.paged_attention(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, q.shape[-1] ** -0.5, out=out
    )


def decode_case(
    batch: int,
    context: int,
    rounds: int,
    stream_read_gbs: float,
    shape: AttentionShape = QWEN2_VL_2B,
    dtype: torch.dtype = torch.float32,
) -> Result:
    q, k, v, cache, meta = paged_step([1] * batch, [context] * batch, shape=shape, dtype=dtype)
    out = torch.empty_like(q)
    backend = TorchAttentionBackend()
    scale = shape.head_dim**-0.5
    args = (meta.query_start_loc, meta.seq_lens, meta.block_table, scale)
    ms = time_interleaved(
        {
            "kernel": lambda: kernel_forward(q, k, v, cache, meta, out),
            "attention only": lambda: cpu.paged_attention(q, cache, *args, out=out),
            "engine": lambda: backend.forward(q, k, v, cache, meta, scale),
            "reference": lambda: reference.paged_attention(q, cache, *args),
        },
        rounds,
    )
    kv_bytes = batch * context * shape.kv_heads * shape.head_dim * 2 * cache.element_size()
    gbs = kv_bytes / ms["attention only"] / 1e9
    label = "" if shape == QWEN2_VL_2B and dtype == torch.float32 else f" {shape.name} {str(dtype)[6:]}"
    return Result(
        f"decode{label} b={batch} ctx={context}",
        ms,
        {"K/V GB/s": gbs, "% of read BW": 100 * gbs / stream_read_gbs},
    )


def prefill_case(chunk: int, context: int, rounds: int) -> Result:
    q, k, v, cache, meta = paged_step([chunk], [context])
    out = torch.empty_like(q)
    backend = TorchAttentionBackend()
    scale = HEAD_DIM**-0.5
    # SDPA on contiguous [1, H, S, D] tensors of the same context, the mask offset by the cache.
    keys = torch.randn(1, KV_HEADS, context, HEAD_DIM)
    values = torch.randn(1, KV_HEADS, context, HEAD_DIM)
    queries = q.transpose(0, 1)[None].contiguous()
    mask = torch.arange(context)[None, :] <= torch.arange(context - chunk, context)[:, None]
    causal = context == chunk

    def sdpa():
        if causal:
            return F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )

    ms = time_interleaved(
        {
            "kernel": lambda: kernel_forward(q, k, v, cache, meta, out),
            "engine": lambda: backend.forward(q, k, v, cache, meta, scale),
            "sdpa contiguous": sdpa,
        },
        rounds,
    )
    return Result(f"prefill chunk={chunk} ctx={context}", ms)


def vision_case(name: str, bounds: list[int], rounds: int) -> Result:
    heads, head_dim = 16, 80
    q, k, v = (torch.randn(bounds[-1], heads, head_dim) for _ in range(3))
    scale = head_dim**-0.5
    ms = time_interleaved(
        {
            "kernel": lambda: cpu.varlen_attention(q, k, v, bounds, scale),
            "engine": lambda: torch_varlen_attention(q, k, v, bounds, scale),
            "reference": lambda: reference.varlen_attention(q, k, v, bounds, scale),
        },
        rounds,
    )
    return Result(f"varlen {name}", ms)


def rowwise_cases(tokens: int, rounds: int) -> list[Result]:
    x = torch.randn(tokens, HIDDEN)
    residual = torch.randn(tokens, HIDDEN)
    norm = RMSNorm(HIDDEN)
    weight = norm.weight.detach()
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE)
    rope = MRotaryEmbedding(HEAD_DIM, 1e6, [16, 24, 24], 4096)
    positions = torch.randint(0, 4096, (3, tokens))
    q, k = torch.randn(tokens, HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
    caches = (rope.cos_cache, rope.sin_cache, rope.section_of_channel)
    kv = torch.randn(2, tokens // BLOCK + 1, BLOCK, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(kv.shape[1] * BLOCK)[:tokens]
    kv_flat = kv.view(2, -1, KV_HEADS, HEAD_DIM)

    def engine_write_kv():  # the engine backend's write
        kv_flat[0].index_copy_(0, slots, k)
        kv_flat[1].index_copy_(0, slots, k)

    with torch.no_grad():
        groups = {
            "rms_norm": {
                "kernel": lambda: cpu.rms_norm(x, weight, 1e-6),
                "engine": lambda: norm(x),
                "reference": lambda: reference.rms_norm(x, weight, 1e-6),
            },
            "fused_add_rms_norm": {
                "kernel": lambda: cpu.fused_add_rms_norm(x, residual, weight, 1e-6),
                "engine": lambda: norm(x + residual),
                "reference": lambda: reference.fused_add_rms_norm(x, residual, weight, 1e-6),
            },
            "silu_and_mul": {
                "kernel": lambda: cpu.silu_and_mul(gate_up),
                "engine": lambda: SiluAndMul()(gate_up),
                "reference": lambda: reference.silu_and_mul(gate_up),
            },
            "mrope": {
                "kernel": lambda: cpu.mrope(q, k, positions, *caches),
                "engine": lambda: rope(positions, q, k),
                "reference": lambda: reference.mrope(q, k, positions, *caches),
            },
            "write_kv": {
                "kernel": lambda: cpu.write_kv(k, k, kv, slots),
                "engine": engine_write_kv,
                "reference": lambda: reference.write_kv(k, k, kv, slots),
            },
        }
        return [
            Result(f"{name} T={tokens}", time_interleaved(group, rounds)) for name, group in groups.items()
        ]


def stream_bandwidth(rounds: int) -> dict[str, float]:
    """GB/s of a 256 MiB copy (read + write bytes, as STREAM counts) and of a read-only sum."""
    src = torch.randn(64 * 1024 * 1024)
    dst = torch.empty_like(src)
    ms = time_interleaved({"copy": lambda: dst.copy_(src), "read": lambda: src.sum()}, rounds)
    nbytes = src.numel() * src.element_size()
    return {"copy GB/s": 2 * nbytes / ms["copy"] / 1e9, "read GB/s": nbytes / ms["read"] / 1e9}


def print_result(result: Result) -> None:
    kernel = result.ms["kernel"]
    timings = "  ".join(f"{name} {ms * 1e3:8.3f}ms" for name, ms in result.ms.items())
    ratios = "  ".join(
        f"{name}/kernel {ms / kernel:6.2f}x" for name, ms in result.ms.items() if name != "kernel"
    )
    extra = "  ".join(f"{name} {value:.1f}" for name, value in result.extra.items())
    print(f"{result.case:<38} {timings}  | {ratios}  {extra}", flush=True)


def run(threads: int, rounds: int, mid_decode_only: bool = False) -> dict:
    torch.set_num_threads(threads)
    print(f"\n== {threads} thread(s), median of {rounds} interleaved rounds ==", flush=True)
    bandwidth = stream_bandwidth(rounds)
    print("memory: " + "  ".join(f"{name} {value:.1f}" for name, value in bandwidth.items()), flush=True)
    results = []
    if mid_decode_only:
        for dtype in (torch.float32, torch.bfloat16):
            for batch in (1, 8):
                for context in (256, 300, 512, 2048):
                    results.append(decode_case(batch, context, rounds, bandwidth["read GB/s"], MID, dtype))
                    print_result(results[-1])
        return {"threads": threads, "bandwidth": bandwidth, "results": [vars(r) for r in results]}
    for batch in (1, 8, 32):
        for context in (256, 512, 1024, 2048):
            results.append(decode_case(batch, context, rounds, bandwidth["read GB/s"]))
            print_result(results[-1])
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 8):
            for context in (256, 512, 2048):
                results.append(decode_case(batch, context, rounds, bandwidth["read GB/s"], MID, dtype))
                print_result(results[-1])
    for chunk, context in ((512, 512), (512, 2048)):
        results.append(prefill_case(chunk, context, rounds))
        print_result(results[-1])
    images = {"1 image 1024 patches": [0, 1024], "16 windows of 64": list(range(0, 1025, 64))}
    for name, bounds in images.items():
        results.append(vision_case(name, bounds, rounds))
        print_result(results[-1])
    for tokens in (1, 512):
        for result in rowwise_cases(tokens, rounds):
            results.append(result)
            print_result(result)
    return {"threads": threads, "bandwidth": bandwidth, "results": [vars(r) for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument(
        "--mid-decode-only", action="store_true", help="only the mid model's decode rows (256-2048 keys)"
    )
    args = parser.parse_args()
    if not cpu.is_available():
        raise SystemExit("the CPU kernels could not be built here")
    runs = [run(threads, args.rounds, args.mid_decode_only) for threads in args.threads]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(runs, handle, indent=1)


if __name__ == "__main__":
    main()
