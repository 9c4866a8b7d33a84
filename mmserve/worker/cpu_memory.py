"""Freed memory kept in the process's heap for reuse, instead of handed back to the kernel.

glibc's malloc serves a request of 128 KiB or more (its threshold adapts up to 32 MiB) with a
fresh `mmap` and unmaps it when freed, and the kernel zeroes each page of the next mapping when
it is first touched. A model on the CPU allocates and frees its activations in every layer, and
a vision tower's are large: for a 1024×768 image the mid model's MLP output alone is ~4,000 rows
× 2,560 bf16 values, 20 MB. The mid server's engine spent 8.5 % of its CPU time in the kernel's
`clear_page` (perf, under `vllm bench serve`), ~90,000 page faults per image
(BENCHMARKS.md, "Zen 4, stop 39").

`keep_freed_memory` turns malloc's mmap off (M_MMAP_MAX 0: every block comes from the heap) and
stops it trimming the heap's top, so freed activations are reused, pages and all (a block of
exactly a request's size may still be passed over: torch asks for aligned blocks, which glibc
serves from a slightly larger free one, so the heap can grow by an activation before freed
neighbours coalesce). That is what vLLM's CPU backend gets by preloading tcmalloc. The price is
a caching allocator's: the heap stays at its high-water mark. Where the user set malloc's
variables (`MALLOC_*_` or a `glibc.malloc` tunable), or the C library is not glibc, nothing
changes.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger("mmserve.worker")

# mallopt parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: ~2 GiB of free heap top before any is returned


def user_tunes_malloc(environ: os._Environ[str] | dict[str, str]) -> bool:
    """True where `environ` holds a glibc malloc setting of the user's, which we leave alone."""
    return any(name.startswith("MALLOC_") for name in environ) or "glibc.malloc" in environ.get(
        "GLIBC_TUNABLES", ""
    )


def keep_freed_memory() -> bool:
    """Set this process's malloc to keep freed memory (module docstring); True if it now does."""
    if user_tunes_malloc(os.environ):
        logger.info("malloc left as the environment sets it")
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        logger.info("no mallopt here (not glibc): freed memory goes back to the kernel")
        return False
    # mallopt returns 1 on success
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, _NEVER_TRIM))
