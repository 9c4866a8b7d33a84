"""Code run in separate processes by the pool tests; imports only what a consumer would."""

from __future__ import annotations

import numpy as np

from preprocess.shm import ShmHandle, attach


def attach_and_inspect(handle: ShmHandle) -> tuple[float, bool, str]:
    """Map the pixels read-only, sum them, and try to write one."""
    pixels = attach(handle)
    try:
        pixels[0, 0] = 0.0
        write = "allowed"
    except ValueError as exc:
        write = str(exc)
    return float(pixels.astype(np.float64).sum()), bool(pixels.flags.writeable), write


def exit_at_start(*args: object) -> None:
    """Stands in for the worker entry point: a worker that can never start."""
    raise SystemExit(3)
