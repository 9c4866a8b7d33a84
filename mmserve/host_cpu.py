"""What this CPU is, as every CPU path choice sees it: /proc/cpuinfo's flags and vendor, less
what MMSERVE_CPU_FLAGS_OFF hides and with MMSERVE_CPU_VENDOR's vendor (one machine taking
another's paths, for tests and benchmarks). No torch: the configuration reads it too."""

from __future__ import annotations

import contextlib
from pathlib import Path

from mmserve import envs


def info(field: str) -> str:
    """The first value of one /proc/cpuinfo field ('' where there is no such file or field)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    return ""


def flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them, less those MMSERVE_CPU_FLAGS_OFF
    names (envs.cpu_flags_off)."""
    listed = info("flags")
    off = envs.cpu_flags_off()
    return " ".join(flag for flag in listed.split() if flag not in off) if off else listed


def vendor() -> str:
    """The CPU's vendor id as /proc/cpuinfo gives it (GenuineIntel, AuthenticAMD, ...), or
    MMSERVE_CPU_VENDOR's."""
    return envs.cpu_vendor() or info("vendor_id")
