"""The timing half of benchmarks/gpu_check.py (CUDA, bfloat16): every figure next to the limit the
hardware sets, measured in the same run.

- HBM bandwidth: a 4 GiB device copy (read + write counted) and a read-only sum.
- bf16 matmul ceiling: 8192² matmuls.
- Decode: whole engine steps (`EngineCore.step`) of B requests decoding at 512 tokens of
  context, B = 1 / 8 / 64, graphs on and off (the same engine with its graphs detached), for the
  mid model and the 2B-shaped Qwen2-VL (auto backend: Triton at block size 16), and the 2B one
  again with flash-attn at block size 256 where it is installed; floor = (weights + KV read
  per step) ÷ read bandwidth.
- Prefill: one 8192-token step of the 2B-shaped model; its FLOPs (2 x parameters x tokens plus
  causal attention) ÷ time against the matmul ceiling.
- VisionArena-style offline throughput: `LLM.chat` over seeded VisionArena-format rows (the
  first turn, its image), mid model, 32 output tokens each, preprocessing included.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.decode_bandwidth import decode_steps, weight_bytes
from mmserve.bench.dataset import make_row
from mmserve.entrypoints.llm import LLM
from mmserve.ops import flash_attn
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint

DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXT = 512
DECODE_STEPS = 20
PREFILL_TOKENS = 8192


def cuda_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Mean seconds of `fn` on the device (CUDA events), after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def hbm_bandwidth() -> dict:
    num_bytes = 4 << 30
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = cuda_seconds(lambda: dst.copy_(src), 10)
    read_s = cuda_seconds(lambda: src.sum(), 10)
    return {"copy_bytes_per_s": 2 * num_bytes / copy_s, "read_bytes_per_s": num_bytes / read_s}


def matmul_ceiling() -> dict:
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = cuda_seconds(lambda: a @ b, 20)
    return {"bf16_flops_per_s": 2 * n**3 / seconds, "shape": [n, n, n]}


def timing_engine(preset: str, max_num_seqs: int, max_num_batched_tokens: int, **options) -> LLM:
    """bf16 engine with the defaults a CUDA user gets (auto backend, compiled, graphs)."""
    block_size = options.get("block_size", 16)
    tokens = max_num_seqs * (DECODE_CONTEXT + DECODE_STEPS + 2 * block_size) + max_num_batched_tokens
    return LLM(
        checkpoint("qwen2_vl", preset),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_kv_blocks=tokens // block_size + 64,
        **options,
    )


def decode_vs_floor(preset: str, read_bytes_per_s: float, **options) -> dict:
    with timing_engine(preset, max(DECODE_BATCHES), 8192, **options) as llm:
        runner = llm.engine_core.executor.runner
        config = llm.config.model
        kv_per_token = (
            2
            * config.num_layers
            * config.num_kv_heads
            * config.head_dim
            * getattr(torch, config.dtype).itemsize
        )
        weights = weight_bytes(llm)
        rows = []
        for batch in DECODE_BATCHES:
            graphs = runner.decode_graphs
            with_graphs = statistics.median(decode_steps(llm, batch, DECODE_CONTEXT, DECODE_STEPS))
            runner.decode_graphs = None
            without = statistics.median(decode_steps(llm, batch, DECODE_CONTEXT, DECODE_STEPS))
            runner.decode_graphs = graphs
            kv = batch * (DECODE_CONTEXT + DECODE_STEPS // 2) * kv_per_token
            floor = (weights + kv) / read_bytes_per_s
            rows.append(
                {
                    "batch": batch,
                    "step_s_graphs": with_graphs,
                    "step_s_no_graphs": without,
                    "floor_s": floor,
                    "floor_over_step_graphs": floor / with_graphs,
                    "floor_over_step_no_graphs": floor / without,
                }
            )
        return {
            "model": f"qwen2_vl-{preset}",
            "attention_backend": runner.attention_backend.name,
            "graphs_captured": runner.decode_graphs is not None,
            "weights_bytes": weights,
            "rows": rows,
        }


def flash_attn_decode(read_bytes_per_s: float) -> dict:
    """The 2B-shaped decode rows with flash-attn (block size 256, which it needs), if installed."""
    reason = flash_attn.unsupported_reason(torch.device("cuda"), torch.bfloat16, 256)
    if reason is not None:
        return {"skipped": reason}
    return decode_vs_floor("2b", read_bytes_per_s, attention_backend="flash_attn", block_size=256)


def prefill_flops(llm: LLM, prompt_lens: list[int]) -> float:
    """Matmul FLOPs of one prefill step: 2 x the decoder layers' parameters per token, plus
    causal attention's QK and PV products (the LM head runs on the sampled rows only)."""
    config = llm.config.model
    model = llm.engine_core.executor.runner.model
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    pairs = sum(n * (n + 1) / 2 for n in prompt_lens)
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * pairs
    return 2 * layer_params * sum(prompt_lens) + attention


def prefill_vs_ceiling(flops_per_s: float) -> dict:
    prompt_lens = [2048] * (PREFILL_TOKENS // 2048)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with timing_engine("2b", 8, PREFILL_TOKENS) as llm:
        rng = np.random.default_rng(0)
        seconds = []
        for _ in range(3):  # the first round compiles and warms up
            prompts = [{"prompt_token_ids": rng.integers(100, 11000, n).tolist()} for n in prompt_lens]
            for prompt in prompts:
                llm._submit(llm._inputs.prompt(prompt), params)
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.engine_core.step()  # the whole budget: every prompt in one step
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            while llm.engine_core.has_work():
                llm.engine_core.step()
        step = min(seconds[1:])
        flops = prefill_flops(llm, prompt_lens)
        return {
            "tokens": sum(prompt_lens),
            "step_s": step,
            "flops": flops,
            "fraction_of_ceiling": flops / step / flops_per_s,
        }


def visionarena_throughput(num_rows: int = 64, output_len: int = 32) -> dict:
    import base64

    def conversation(index: int) -> list[dict]:
        row = make_row(index, seed=0)
        data = row["images"][0]["bytes"]
        mime = "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"
        url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
        text = row["conversation"][0][0]["content"]
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        return [{"role": "user", "content": parts}]

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with timing_engine("mid", 64, 8192) as llm:
        llm.chat([conversation(10_000 + i) for i in range(4)], params)  # warm-up
        conversations = [conversation(i) for i in range(num_rows)]
        start = time.perf_counter()
        outputs = llm.chat(conversations, params)
        seconds = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "requests": num_rows,
        "seconds": seconds,
        "requests_per_s": num_rows / seconds,
        "output_tokens_per_s": output_tokens / seconds,
    }


def run_timings(
    within_budget: Callable[[], bool], run_section: Callable[[str, Callable[[], dict]], dict]
) -> dict:
    """Every section in order; those that would start past the budget are skipped and say so."""
    results: dict[str, dict] = {}

    def read_bandwidth() -> float:
        return results["hbm"].get("read_bytes_per_s", float("nan"))

    sections: list[tuple[str, Callable[[], dict]]] = [
        ("hbm", hbm_bandwidth),
        ("matmul", matmul_ceiling),
        ("decode_mid", lambda: decode_vs_floor("mid", read_bandwidth())),
        ("decode_2b", lambda: decode_vs_floor("2b", read_bandwidth())),
        ("decode_2b_flash_attn", lambda: flash_attn_decode(read_bandwidth())),
        ("prefill_2b", lambda: prefill_vs_ceiling(results["matmul"].get("bf16_flops_per_s", float("nan")))),
        ("visionarena_mid", visionarena_throughput),
    ]
    for name, fn in sections:
        results[name] = run_section(name, fn) if within_budget() else {"skipped": "past the time budget"}
    return results
