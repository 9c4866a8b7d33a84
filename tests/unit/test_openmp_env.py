"""The engine process starts with libgomp's spin count cut (mmserve.openmp_env), unless the user
chose a wait policy or spin count; the starting process's own environment is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve.engine_args import EngineArgs
from mmserve.frontend.core_client import MPCoreClient
from mmserve.openmp_env import SPIN_COUNT, child_settings, model_process_environment
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.run_apart import run_apart


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in entries if entry)


def child_sees(name: str) -> str | None:
    out = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.environ.get({name!r}, '<unset>'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return None if out == "<unset>" else out


@pytest.fixture
def no_user_setting(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)


def test_the_spin_count_is_set_only_where_the_user_chose_nothing():
    assert child_settings({}) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    assert child_settings({"GOMP_SPINCOUNT": "300000"}) == {}
    assert child_settings({"OMP_WAIT_POLICY": "ACTIVE"}) == {}


def test_a_process_started_inside_gets_it_and_the_parent_is_restored(no_user_setting):
    with model_process_environment():
        assert child_sees("GOMP_SPINCOUNT") == str(SPIN_COUNT)
    assert "GOMP_SPINCOUNT" not in os.environ
    assert child_sees("GOMP_SPINCOUNT") is None


def test_a_users_wait_policy_reaches_the_child_alone(no_user_setting, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with model_process_environment():
        assert child_sees("GOMP_SPINCOUNT") is None
        assert child_sees("OMP_WAIT_POLICY") == "PASSIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_engine_process_runs_with_the_cut_spin_count(no_user_setting):
    client = MPCoreClient(EngineArgs(checkpoint("qwen2_vl"), preprocess_workers=0).create_engine_config())
    try:
        run_apart(client.start())
        assert environment_of(client.process.pid).get("GOMP_SPINCOUNT") == str(SPIN_COUNT)
        assert "GOMP_SPINCOUNT" not in os.environ
    finally:
        client.shutdown()
