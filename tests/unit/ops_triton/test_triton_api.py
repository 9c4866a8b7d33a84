"""What `mmserve.ops.triton` offers: availability, and one wrapper per reference op."""

from __future__ import annotations

import pytest

from mmserve.ops import reference

pytest.importorskip("triton")
import mmserve.ops.triton as triton_ops


def test_available_here():
    """This folder runs on a GPU or in the interpreter its conftest switches on."""
    assert triton_ops.is_available()


def test_a_wrapper_for_every_reference_op():
    attention = ("write_kv", "paged_attention", "varlen_attention")
    for name in (*attention, "rms_norm", "fused_add_rms_norm", "silu_and_mul", "mrope"):
        assert callable(getattr(reference, name))
        assert callable(getattr(triton_ops, name)), name
        assert name in triton_ops.__all__
