"""benchmarks/gpu_check.py, the prepared GPU check, without a GPU: it refuses clearly, and its
correctness checks run on the CPU with --cpu (the Triton kernels in the interpreter, the C++
kernels, the engine against transformers), so the script's logic is tested before a GPU run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import gpu_check

    return gpu_check


def test_without_cuda_it_exits_2_and_says_why(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path / "report.json")]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


def test_a_failed_check_fails_the_run_and_is_in_the_report(gpu_check, monkeypatch, tmp_path):
    monkeypatch.setitem(gpu_check.CHECKS, "backends", lambda device: {"passed": False, "why": "planted"})
    monkeypatch.setitem(gpu_check.CHECKS, "engine", lambda device: 1 / 0)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--cpu", "--checks", "backends", "engine", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["checks"]["backends"]["why"] == "planted"
    assert report["checks"]["engine"]["error"] == "ZeroDivisionError: division by zero"
    assert not report["passed"]


@pytest.mark.slow
@pytest.mark.heavy
def test_the_correctness_checks_pass_on_the_cpu(gpu_check, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "report.json"
    assert gpu_check.main(["--cpu", "--checks", "backends", "engine", "graphs", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    backends = report["checks"]["backends"]["backends"]
    assert set(backends) == {"cpu", "triton"}
    triton_runs = [run for run in backends["triton"]["runs"] if "case" in run]
    assert len(triton_runs) == 3 and all(run["passed"] for run in triton_runs)
    families = report["checks"]["engine"]["families"]
    assert set(families) == {"qwen2_vl", "qwen2_5_vl"}
    assert all(row["passed"] and row["prompt_tokens"] > 32 for row in families["qwen2_vl"][:1])
    assert report["checks"]["graphs"] == {"skipped": "CUDA graphs need a CUDA device", "seconds": 0.0}
    assert "timings" not in report
