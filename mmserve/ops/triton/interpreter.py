"""Triton's CPU interpreter made to compute what a GPU computes, for running the Triton kernels
on CPU tensors (tests, and `--attention-backend triton` without a GPU).

`@triton.jit` picks compiled or interpreted when a function is defined, so TRITON_INTERPRET=1
must be set before triton and these kernels are imported; `enable()` sets it, repairs
triton.language's own functions if triton was imported earlier in compiled mode, and patches the
interpreter's bfloat16 arithmetic. The kernels themselves are untouched.
"""

from __future__ import annotations

import os

import torch


def enable() -> None:
    """Run Triton kernels in the interpreter from now on (idempotent)."""
    os.environ["TRITON_INTERPRET"] = "1"
    _reinterpret_triton_language()
    _make_interpreter_bfloat16_match_the_gpu()


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

    if getattr(builder, "_mmserve_patched", False):
        return
    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    builder._mmserve_patched = True


def _reinterpret_triton_language() -> None:
    """Rebuild triton.language's own @jit functions for the interpreter if triton was imported
    before TRITON_INTERPRET was set.

    torch._dynamo, for one, imports triton when it probes for it; then `tl.sum`, `tl.max`,
    `tl.cdiv`, … are compiled-mode JITFunctions that refuse to run inside an interpreted kernel.
    The two modules defining them are re-executed (pure Python) and their functions rebound in
    the `triton.language` namespace.
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
