"""Compile the launches the Triton wrappers plan, for NVIDIA GPUs, on a machine without one.

    python tests/unit/ops_triton/compile_for_gpu.py [--arch 90 80]

The interpreter runs kernels but never compiles them; this builds each wrapper's real launch
(its `plan_*` function, on CPU tensors of model-like shapes), specialises the arguments as
Triton's JIT would, and compiles to a cubin with Triton's bundled ptxas. It prints shared
memory, registers and spills per launch, and exits non-zero on a compile error or on shared
memory over the architecture's limit. TRITON_INTERPRET must be 0 (importing mmserve.ops.triton without a GPU
turns the interpreter on where it is unset).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("set TRITON_INTERPRET=0: this compiles kernels instead of interpreting them")

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend

from mmserve.ops.triton.activation import plan_silu_and_mul
from mmserve.ops.triton.kv_cache import plan_write_kv
from mmserve.ops.triton.launch import Launch
from mmserve.ops.triton.norm import plan_rms_norm
from mmserve.ops.triton.rotary import plan_mrope
from mmserve.ops.triton.unified_attention import plan_paged_attention
from mmserve.ops.triton.vision_attention import plan_varlen_attention

SHARED_MEMORY_LIMIT = {90: 227 * 1024, 80: 163 * 1024, 89: 99 * 1024, 86: 99 * 1024}  # per block
# (name, query heads, kv heads, head dim): Qwen2-VL-2B, Qwen2.5-VL-7B, Qwen2.5-VL-3B, the demo model
TEXT_MODELS = [("qwen2-vl-2b", 12, 2, 128), ("qwen2.5-vl-7b", 28, 4, 128), ("demo", 4, 2, 64)]


def paged_attention_launches(quick: bool) -> Iterator[tuple[str, Launch]]:
    """Decode-only steps with and without split-KV, and steps with prompt chunks; quick: one
    model, and half precision for decode, float32 for prompt chunks."""
    for name, heads, kv_heads, head_dim in TEXT_MODELS[1:2] if quick else TEXT_MODELS:
        for dtype in (torch.bfloat16, torch.float32):
            query = torch.empty(8, heads, head_dim, dtype=dtype)
            cache = torch.empty(2, 4, 16, kv_heads, head_dim, dtype=dtype)
            batch = (torch.zeros(3, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
            table = torch.zeros(2, 4, dtype=torch.int32)
            for max_query_len, splits in ((1, 1), (1, 8), (7, 1), (7, 8)):
                if quick and (max_query_len == 1) != (dtype == torch.bfloat16):
                    continue
                launches = plan_paged_attention(
                    torch.empty_like(query), query, cache, *batch, table, 0.1, max_query_len, 64, splits
                )
                for launch in launches:
                    yield f"{name} {dtype} max_query_len={max_query_len} splits={splits}", launch


def other_launches(quick: bool) -> Iterator[tuple[str, Launch]]:
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
        qkv = torch.empty(8, 3, 16, 80, dtype=dtype)  # Qwen2-VL's vision tower: 16 heads of 80
        query, key, value = qkv.unbind(1)
        cu_seqlens = torch.zeros(3, dtype=torch.int32)
        yield (
            f"vision {dtype}",
            plan_varlen_attention(torch.empty_like(query), query, key, value, cu_seqlens, 0.1),
        )
    key = torch.empty(8, 4, 128, dtype=torch.bfloat16)
    cache = torch.empty(2, 4, 16, 4, 128, dtype=torch.bfloat16)
    yield "write_kv", plan_write_kv(key, key, cache, torch.zeros(8, dtype=torch.int64))
    for hidden in (8192,) if quick else (1280, 3584, 8192):
        x = torch.empty(8, hidden, dtype=torch.bfloat16)
        yield f"rms_norm {hidden}", plan_rms_norm(torch.empty_like(x), x, x, x[0], 1e-6)
    gate_up = torch.empty(8, 2 * 18944, dtype=torch.bfloat16)
    yield "silu_and_mul", plan_silu_and_mul(gate_up[:, :18944], gate_up)
    qkv = torch.empty(8, 36, 128, dtype=torch.bfloat16)
    positions, caches = torch.zeros(3, 8, dtype=torch.int64), torch.empty(2, 64, 64)
    row_of_channel = torch.zeros(64, dtype=torch.int64)
    yield "mrope", plan_mrope(qkv[:, :28], qkv[:, 28:32], positions, caches[0], caches[1], row_of_channel)


def specialise(launch: Launch) -> tuple[dict[str, str], dict[str, object], dict[tuple[int], list]]:
    """Signature, constants and attributes as `JITFunction.run` derives them from the arguments."""
    signature, constants, attributes = {}, {}, {}
    for index, param in enumerate(launch.kernel.params):
        value = launch.args[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(CUDABackend, value, False, True, True)
        if param.annotation_type:
            kind = param.annotation_type
        elif kind == "constexpr":  # an int equal to 1 is specialised into the kernel
            constants[param.name] = value
        signature[param.name] = kind
        if isinstance(spec, str):
            attributes[(index,)] = CUDABackend.parse_attr(spec)
    return signature, constants, attributes


def resource_usage(cubin: bytes) -> str:
    """Registers, stack (spills) and local memory of the compiled kernel, from cuobjdump."""
    cuobjdump = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as binary:
        binary.write(cubin)
        binary.flush()
        result = subprocess.run([cuobjdump, "-res-usage", binary.name], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr)
    return " ".join(line.strip() for line in result.stdout.splitlines() if "REG:" in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90])
    parser.add_argument("--quick", action="store_true", help="each kernel in a few configurations")
    args = parser.parse_args()
    failures = 0
    for arch in args.arch:
        for name, launch in [*paged_attention_launches(args.quick), *other_launches(args.quick)]:
            source = triton.compiler.ASTSource(launch.kernel, *specialise(launch))
            options = {"num_warps": launch.num_warps}
            kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            shared = kernel.metadata.shared
            over = shared > SHARED_MEMORY_LIMIT[arch]
            failures += over
            print(
                f"sm_{arch} {launch.kernel.__name__} [{name}] warps={launch.num_warps} shared={shared}"
                f"{' OVER LIMIT' if over else ''} | {resource_usage(kernel.asm['cubin'])}"
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
