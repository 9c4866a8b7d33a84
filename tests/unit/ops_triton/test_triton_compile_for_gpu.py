"""The planned kernel launches compile for an H100/H200 (sm_90) without one being present.

The interpreter runs kernels but never compiles them, so errors only a GPU build shows (types,
layouts, `tl.dot` shapes, shared memory) are caught here, by `compile_for_gpu.py` in a process
of its own: it needs TRITON_INTERPRET=0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")

SCRIPT = Path(__file__).with_name("compile_for_gpu.py")
REPOSITORY = Path(__file__).parents[3]


@pytest.mark.slow
def test_each_kernel_compiles_for_sm90():
    environment = {**os.environ, "TRITON_INTERPRET": "0"}  # compile, do not interpret
    environment["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated to silence its warning
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--arch", "90"],
        cwd=REPOSITORY,
        env=environment,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("sm_90 ")}
    assert compiled == {
        "_paged_attention_kernel",
        "_combine_splits_kernel",
        "_varlen_attention_kernel",
        "_write_kv_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_mrope_kernel",
    }
