"""dtype "auto": the checkpoint's, except where the CPU cannot compute it natively (then float32)."""

from __future__ import annotations

from pathlib import Path

import pytest

import mmserve.engine_args as engine_args_module
from mmserve.config import cpu_computes_natively
from mmserve.engine_args import EngineArgs

DEMO = Path(__file__).resolve().parents[2] / "assets" / "demo-model"  # a bfloat16 checkpoint


@pytest.mark.parametrize("native", [True, False])
def test_auto_keeps_bf16_only_where_the_cpu_computes_it(monkeypatch, native):
    monkeypatch.setattr(engine_args_module, "cpu_computes_natively", lambda dtype: native)
    config = EngineArgs(model=DEMO, device="cpu").create_engine_config()
    assert config.model.dtype == ("bfloat16" if native else "float32")


def test_an_explicit_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(engine_args_module, "cpu_computes_natively", lambda dtype: False)
    config = EngineArgs(model=DEMO, device="cpu", dtype="bfloat16").create_engine_config()
    assert config.model.dtype == "bfloat16"


def test_float32_is_always_native():
    assert cpu_computes_natively("float32")
