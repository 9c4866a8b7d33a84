"""The only reader of MMSERVE_* environment variables.

Every variable is read once, here, through a typed accessor; nothing else in the package calls
os.environ for MMSERVE_* names, so the full list of knobs lives on one screen.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """MMSERVE_CACHE_DIR: where generated test checkpoints and other derived files are kept."""
    default = Path.home() / ".cache" / "mmserve"
    return Path(os.environ.get("MMSERVE_CACHE_DIR", default))


def log_level() -> str:
    """MMSERVE_LOG_LEVEL: default log level when no --log-level flag is given."""
    return os.environ.get("MMSERVE_LOG_LEVEL", "info")


def set_log_level(level: str) -> None:
    """Make `level` what log_level() returns here and in processes started from now on."""
    os.environ["MMSERVE_LOG_LEVEL"] = level


def num_threads() -> int | None:
    """MMSERVE_NUM_THREADS: torch intra-op threads in the engine process (None = the worker's default)."""
    value = os.environ.get("MMSERVE_NUM_THREADS")
    return int(value) if value else None


def cpu_linear() -> str:
    """MMSERVE_CPU_LINEAR: `packed` (default: linear weights repacked after loading for the CPU
    CPU's fastest matmul, mmserve/worker/kernel_plan.py) or `torch` (plain weights and F.linear,
    the reference)."""
    value = os.environ.get("MMSERVE_CPU_LINEAR", "packed")
    if value not in ("packed", "torch"):
        raise ValueError(f"MMSERVE_CPU_LINEAR must be 'packed' or 'torch', got {value!r}")
    return value


def cpu_decoder_layer() -> str:
    """MMSERVE_CPU_DECODER_LAYER: `fused` (default: each language-model decoder layer whose parts
    all run on the CPU kernels is one C++ call, mmserve/worker/kernel_plan.py) or `modules`
    (one call per op, from the layer's modules: the same results, more Python per step)."""
    value = os.environ.get("MMSERVE_CPU_DECODER_LAYER", "fused")
    if value not in ("fused", "modules"):
        raise ValueError(f"MMSERVE_CPU_DECODER_LAYER must be 'fused' or 'modules', got {value!r}")
    return value


def cpu_widen_bf16() -> str:
    """MMSERVE_CPU_WIDEN_BF16: `auto` (default: on CPUs whose float32 FMAs outrun their bfloat16
    dot products, Intel AVX512-BF16 without AMX, a bf16 model's vision tower computes in
    float32; mmserve/worker/kernel_plan.py) or `never` (bf16 throughout, as on other CPUs)."""
    value = os.environ.get("MMSERVE_CPU_WIDEN_BF16", "auto")
    if value not in ("auto", "never"):
        raise ValueError(f"MMSERVE_CPU_WIDEN_BF16 must be 'auto' or 'never', got {value!r}")
    return value


def cpu_flags_off() -> frozenset[str]:
    """MMSERVE_CPU_FLAGS_OFF: /proc/cpuinfo flags (space or comma separated) that the CPU kernels'
    build and every CPU path choice treat as absent (mmserve.host_cpu.flags), so one
    machine can take another's paths: `amx_bf16 amx_tile amx_int8 avx512_fp16` with
    MMSERVE_CPU_VENDOR=AuthenticAMD (and oneDNN capped by ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16) is
    Zen 4 on an AMX Xeon. For tests and benchmarks; empty by default."""
    return frozenset(os.environ.get("MMSERVE_CPU_FLAGS_OFF", "").replace(",", " ").split())


def cpu_vendor() -> str | None:
    """MMSERVE_CPU_VENDOR: the vendor id (GenuineIntel, AuthenticAMD) the CPU path choices assume
    instead of /proc/cpuinfo's (mmserve.host_cpu.vendor); see MMSERVE_CPU_FLAGS_OFF."""
    return os.environ.get("MMSERVE_CPU_VENDOR") or None


def api_key() -> str | None:
    """MMSERVE_API_KEY: the server's API key when --api-key is not given (keeps it out of `ps`)."""
    return os.environ.get("MMSERVE_API_KEY") or None
