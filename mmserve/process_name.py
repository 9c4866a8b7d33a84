"""Name the current process (Linux `comm`, at most 15 bytes), as vLLM names its EngineCore: `ps`,
`top` and the side-by-side benchmark's CPU accounting (`mmserve.bench.process_cpu`) tell the
EngineCore from the API server by it. Elsewhere than Linux it does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15


def set_process_name(name: str) -> None:
    """Set this process's name; longer names are cut to 15 bytes by the kernel."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
