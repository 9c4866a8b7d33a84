"""How long the OpenMP threads of a process that runs the model spin before they sleep.

libgomp (the OpenMP of torch and of the C++ kernels) lets a thread that has finished its share
of a parallel region spin for GOMP_SPINCOUNT pause loops, waiting for the next region, before it
sleeps. Unset, that is 300,000 loops: milliseconds, so the engine's other threads keep their
cores busy through every gap between regions, including each step's scheduling, input
preparation and output handling (Python, on the main thread alone). On a small machine those
are the cores the API server and the preprocess workers need: at concurrency 8 on 2 cores the
spinning was a sixth to a quarter of the server's CPU time (BENCHMARKS.md, "OpenMP spinning").

libgomp reads the variable once, when it loads, so it is set in the environment of a process
about to start (multiprocessing's `spawn`, a Ray actor's runtime_env) and never in a running
one: an offline `LLM` runs the engine in the caller's process, whose OpenMP has already read its
environment. A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# ~0.08 ms of spinning on Zen 4 (0.4–0.6 ms at 10,000, ~9 ms unset; `python -m
# benchmarks.openmp_spin`): the gaps between one forward pass's regions of a large model, not the
# Python between a small model's ops. 10,000 spun through those too: on 2 cores at concurrency 8,
# 1,000 cut the engine's CPU per request by 14 % (tiny) and 15 % (mid) and served 1.03× / 1.09×
# the requests (BENCHMARKS.md, "Zen 4, stop 40"); 0 (sleep at once) served 0.82×.
SPIN_COUNT = 1_000

_USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def child_settings(environ: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    """The OpenMP variables a model-running child of a process with `environ` should get on top
    of it: none where the user chose a wait policy or spin count."""
    if any(name in environ for name in _USER_SETTINGS):
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


@contextlib.contextmanager
def model_process_environment() -> Iterator[None]:
    """Within: os.environ also holds `child_settings(os.environ)`, for the processes started
    inside; afterwards it is as it was."""
    added = child_settings(os.environ)
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
