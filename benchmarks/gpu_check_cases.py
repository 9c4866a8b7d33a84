"""The correctness checks of benchmarks/gpu_check.py; each takes the device and returns a JSON-able
dict with `passed` (or `skipped` and why) and the numbers behind it."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.entrypoints.llm import LLM
from mmserve.layers.attention import AttentionMetadata, get_attention_backend
from mmserve.ops import reference
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import Reference, png_bytes, synthetic_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class StepCase:
    """A random paged step: each request's query length and its context length after the step."""

    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int


STEP_CASES = (
    StepCase("mixed, long split-KV decode, GQA 6", (1, 1, 7, 33, 1), (5, 300, 7, 80, 1100), 12, 2, 128),
    StepCase("decode batch, GQA 2", (1,) * 6 + (16,), (17, 1, 64, 65, 200, 31, 40), 4, 2, 32),
    StepCase("prompt chunks, no GQA", (3, 1, 20), (40, 17, 20), 8, 8, 64),
)


def random_step(case: StepCase, block_size: int, dtype: torch.dtype, device: torch.device, seed: int):
    """(q, k, v, kv_cache, metadata) of one step; block ids drawn at random (tables with holes)."""
    rng = np.random.default_rng(seed)
    query_lens, seq_lens = np.array(case.query_lens), np.array(case.seq_lens)
    blocks_per_request = -(-seq_lens // block_size)
    num_blocks = int(blocks_per_request.sum()) + 8
    block_ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(seq_lens), int(blocks_per_request.max())), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(blocks_per_request)])
    for r, count in enumerate(blocks_per_request):
        table[r, :count] = block_ids[starts[r] : starts[r] + count]
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    slots = []
    for r in range(len(seq_lens)):
        positions = np.arange(seq_lens[r] - query_lens[r], seq_lens[r])
        slots.append(table[r, positions // block_size].astype(np.int64) * block_size + positions % block_size)
    num_tokens = int(query_lens.sum())

    def randn(*shape):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + len(shape))).to(
            device, dtype
        )

    q = randn(num_tokens, case.num_heads, case.head_dim)  # [T, H, D]
    k = randn(num_tokens, case.num_kv_heads, case.head_dim)  # [T, KVH, D]
    v = randn(num_tokens, case.num_kv_heads, case.head_dim) * 0.5
    kv_cache = randn(2, num_blocks, block_size, case.num_kv_heads, case.head_dim)  # [2, B, S, KVH, D]
    metadata = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return q, k, v, kv_cache, metadata


def compare_backend(
    name: str, case: StepCase, block_size: int, dtype: torch.dtype, device: torch.device
) -> dict:
    """One backend's forward (KV write + attention) against reference.write_kv + paged_attention."""
    backend = get_attention_backend(name, device, dtype, block_size)
    q, k, v, kv_cache, metadata = random_step(case, block_size, dtype, device, seed=len(case.name))
    expected_cache = kv_cache.clone()
    reference.write_kv(k, v, expected_cache, metadata.slot_mapping)
    scale = case.head_dim**-0.5
    expected = reference.paged_attention(
        q, expected_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table, scale
    )
    out = backend.forward(q, k, v, kv_cache, metadata, scale)
    error = (out.float() - expected.float()).abs().max().item()
    cache_error = (kv_cache.float() - expected_cache.float()).abs().max().item()
    return {
        "case": case.name,
        "dtype": str(dtype),
        "block_size": block_size,
        "max_error": error,
        "cache_error": cache_error,
        "passed": error <= TOLERANCE[dtype] and cache_error == 0.0,
    }


def compare_kernel_set(name: str, dtype: torch.dtype, device: torch.device) -> dict:
    """The backend's kernel set (norms, SiLU-and-mul, M-RoPE, vision varlen attention) against
    the reference ops, on one random input each; the largest error over them."""
    kernels = get_attention_backend(name, device, dtype, 256 if name == "flash_attn" else 16).kernels
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x, residual, weight = randn(37, 256), randn(37, 256), randn(256)
    gate_up = randn(37, 512)
    q, k = randn(37, 8, 64), randn(37, 2, 64)
    positions = torch.randint(0, 100, (3, 37), generator=gen).to(device)
    cos, sin = torch.rand(128, 32, generator=gen).to(device), torch.rand(128, 32, generator=gen).to(device)
    rows = (torch.arange(32) % 3).to(device)
    vq, vk, vv = randn(100, 4, 64), randn(100, 4, 64), randn(100, 4, 64)
    cu_seqlens = [0, 16, 64, 100]
    pairs = {
        "rms_norm": (kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)),
        "fused_add_rms_norm": (
            kernels.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)[0],
            reference.fused_add_rms_norm(x, residual, weight, 1e-6)[0],
        ),
        "silu_and_mul": (kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)),
        "mrope": (
            kernels.mrope(q.clone(), k.clone(), positions, cos, sin, rows)[0],
            reference.mrope(q, k, positions, cos, sin, rows)[0],
        ),
        "varlen_attention": (
            kernels.varlen_attention(vq, vk, vv, cu_seqlens, 0.125),
            reference.varlen_attention(vq, vk, vv, cu_seqlens, 0.125),
        ),
    }
    errors = {op: (a.float() - b.float()).abs().max().item() for op, (a, b) in pairs.items()}
    return {"dtype": str(dtype), "max_error": errors, "passed": max(errors.values()) <= 2 * TOLERANCE[dtype]}


def check_backends(device: torch.device) -> dict:
    names = ("triton", "flash_attn") if device.type == "cuda" else ("cpu", "triton")
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    results: dict[str, dict] = {}
    for name in names:
        runs = []
        for dtype in dtypes:
            block_size = 256 if name == "flash_attn" else 16
            try:
                get_attention_backend(name, device, dtype, block_size)
            except (ValueError, RuntimeError) as e:  # cannot run here (not installed, dtype, block size)
                runs.append({"dtype": str(dtype), "skipped": str(e)})
                continue
            runs += [compare_backend(name, case, block_size, dtype, device) for case in STEP_CASES]
            runs.append({"kernel_set": compare_kernel_set(name, dtype, device)})
        results[name] = {"runs": runs}
    flat = [run.get("kernel_set", run) for result in results.values() for run in result["runs"]]
    ran = [run for run in flat if "skipped" not in run]
    return {"backends": results, "passed": bool(ran) and all(run["passed"] for run in ran)}


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_conversation(seed: int, question: str) -> tuple[list[dict], list[dict], list]:
    """(messages for our engine, the same for the reference, the images)."""
    image = synthetic_image(300, 200, seed=seed)
    ours = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": question},
            ],
        }
    ]
    theirs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return ours, theirs, [image]


def text_conversation(question: str) -> tuple[list[dict], list[dict], list]:
    ours = [{"role": "user", "content": question}]
    return ours, [{"role": "user", "content": [{"type": "text", "text": question}]}], []


def eager_backend(device: torch.device) -> str:
    """The backend the float32 engine checks run: Triton on CUDA (flash-attn has no float32)."""
    return "triton" if device.type == "cuda" else "auto"


def check_engine(device: torch.device) -> dict:
    """Greedy tokens of our engine (eager, float32, prompts chunked at 32 tokens) against
    transformers on the same device, both Qwen2 families."""
    torch.backends.cudnn.allow_tf32 = False  # transformers' patch embedding is a convolution
    cases = [
        image_conversation(1, "Describe the image."),
        text_conversation("Tell me a joke about triangles."),
    ]
    families = {}
    for family in ("qwen2_vl", "qwen2_5_vl"):
        model_dir = checkpoint(family)
        ref = Reference(model_dir, device=device)
        with LLM(
            model_dir,
            dtype="float32",
            device=device.type,
            attention_backend=eager_backend(device),
            enforce_eager=True,
            max_num_batched_tokens=32,
            num_kv_blocks=256,
        ) as llm:
            outputs = llm.chat([ours for ours, _, _ in cases], GREEDY)
        rows = []
        for (_, theirs, images), out in zip(cases, outputs, strict=True):
            prompt = ref.build_prompt(theirs, images)
            expected = ref.generate(prompt, GREEDY.max_tokens).token_ids
            rows.append(
                {
                    "prompt_tokens": len(prompt.token_ids),
                    "prompt_matches": out.prompt_token_ids == prompt.token_ids,
                    "ours": out.outputs[0].token_ids,
                    "transformers": expected,
                    "passed": out.prompt_token_ids == prompt.token_ids
                    and out.outputs[0].token_ids == expected,
                }
            )
        families[family] = rows
    return {"families": families, "passed": all(r["passed"] for rows in families.values() for r in rows)}


def batch_tokens(llm: LLM, batch_size: int) -> list[list[int]]:
    """Greedy tokens of `batch_size` text prompts of different lengths plus one image chat."""
    rng = np.random.default_rng(batch_size)
    prompts = [
        {"prompt_token_ids": rng.integers(100, 2000, int(rng.integers(3, 60))).tolist()}
        for _ in range(batch_size)
    ]
    texts = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    [image_chat] = llm.chat(image_conversation(batch_size, "What is in the picture?")[0], GREEDY)
    return [*texts, image_chat.outputs[0].token_ids]


def engine_variant(device: torch.device, **options) -> LLM:
    return LLM(
        checkpoint("qwen2_vl"),
        dtype="float32",
        device=device.type,
        attention_backend=eager_backend(device),
        max_num_seqs=32,
        num_kv_blocks=512,
        **options,
    )


def compare_variants(device: torch.device, options: dict, batch_sizes=(1, 3, 9, 20)) -> dict:
    """Tokens of the engine with `options` against the eager engine, batch by batch."""
    with engine_variant(device, enforce_eager=True) as eager:
        expected = {n: batch_tokens(eager, n) for n in batch_sizes}
    with engine_variant(device, **options) as variant:
        got = {n: batch_tokens(variant, n) for n in batch_sizes}
        graphs = variant.engine_core.executor.runner.decode_graphs
        replays = graphs.num_replays if graphs is not None else 0
        sizes = graphs.sizes if graphs is not None else []
    mismatched = [n for n in batch_sizes if got[n] != expected[n]]
    return {
        "mismatched_batches": mismatched,
        "graph_replays": replays,
        "capture_sizes": sizes,
        "ok": not mismatched,
    }


def check_graphs(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    result = compare_variants(device, {"compilation_config": {"level": 0}})
    return result | {"passed": result["ok"] and result["graph_replays"] > 0}


def check_compile(device: torch.device) -> dict:
    """The compiled language model (with decode graphs on CUDA) against the eager engine."""
    result = compare_variants(device, {"compilation_config": {"level": 1}}, batch_sizes=(1, 9))
    return result | {"passed": result["ok"]}


def check_syncs(device: torch.device) -> dict:
    """No host sync inside the language model's forward (rotary, attention metadata, kernels):
    every forward of a few eager steps, prompt chunks and decodes, runs under
    torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising call."""
    if device.type != "cuda":
        return {"skipped": "sync debug mode needs a CUDA device"}
    with engine_variant(device, enforce_eager=True) as llm:
        model = llm.engine_core.executor.runner.model
        forward = model.forward
        calls = 0

        def strict_forward(*args, **kwargs):
            nonlocal calls
            calls += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return forward(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        model.forward = strict_forward
        batch_tokens(llm, 3)
    return {"forwards_checked": calls, "passed": calls > 0}
