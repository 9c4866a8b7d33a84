"""Run the Triton kernels on a GPU when there is one, else on CPU tensors in Triton's interpreter.

`@triton.jit` picks compiled or interpreted when a kernel is defined, i.e. when
`mmserve.ops.triton` is first imported, so TRITON_INTERPRET=1 is set here, before any test module
of this folder imports it (setting it in tests/conftest.py instead would also cover kernels that
other packages import earlier during collection). The tests skip (per module) only where Triton
cannot be imported.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()

if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    if any(name.startswith("mmserve.ops.triton.") for name in sys.modules):
        raise RuntimeError(
            "mmserve.ops.triton was imported before tests/unit/ops_triton/conftest.py could set "
            "TRITON_INTERPRET=1; set it earlier (tests/conftest.py) so the kernels are interpreted"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _make_interpreter_bfloat16_match_the_gpu() -> None:
    """Two fixes to the interpreter's bfloat16, which it stores as uint16 bit patterns.

    - `tl.dot` multiplies the bit patterns (triton-lang/triton#11584: "we just don't support it
      yet"). Its operands are converted to float32 first: exact, since a product of two bfloat16
      values fits in float32, and what a GPU's float32-accumulated bfloat16 MMA computes.
    - float32 → bfloat16 casts truncate, where a GPU's `cvt.rn.bf16.f32` rounds to nearest even;
      they are rounded to nearest even (by torch) instead.
    The kernels themselves are left untouched.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original_dot, original_cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, *args, **kwargs):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return original_dot(self, a, b, *args, **kwargs)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.array(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl


def _reinterpret_triton_language() -> None:
    """Rebuild triton.language's own @jit functions for the interpreter if triton was imported
    before TRITON_INTERPRET was set.

    Collecting the whole suite imports triton early (torch._dynamo probes for it while
    tests/unit/layers is collected), and then `tl.sum`, `tl.max`, `tl.cdiv`, … are compiled-mode
    JITFunctions that refuse to run inside an interpreted kernel. Setting TRITON_INTERPRET in
    tests/conftest.py would make this unnecessary; until then the two modules defining them are
    re-executed (pure Python) and their functions rebound in the `triton.language` namespace.
    """
    import importlib

    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if not isinstance(tl.sum, JITFunction):
        return
    for module in (tl.standard, tl.random):
        importlib.reload(module)
        for name, value in vars(module).items():
            if isinstance(getattr(tl, name, None), JITFunction):
                setattr(tl, name, value)


try:
    import triton  # noqa: F401
except ImportError:
    pass
else:
    if not ON_GPU:
        _reinterpret_triton_language()
        _make_interpreter_bfloat16_match_the_gpu()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
