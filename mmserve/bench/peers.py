"""Servers to compare, each started on loopback as its own process group and stopped after its run.

A peer is written `NAME=KIND[:ARGS]`: KIND is mmserve, hf (the transformers baseline), vllm or
vllm-tuned; ARGS are extra server flags, led by any VAR=value environment settings, e.g.
    best=mmserve:MMSERVE_NUM_THREADS=2 --dtype bfloat16 --max-num-batched-tokens 4096
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("mmserve", "hf", "vllm", "vllm-tuned")
_ENV_TOKEN = re.compile(r"^[A-Z_][A-Z0-9_]*=")

# What vLLM's CPU build needs here (see benchmarks/setup_vllm.sh), and its tuned extras.
_VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@dataclass(frozen=True)
class Peer:
    name: str
    kind: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Peer:
        name, _, rest = spec.partition("=")
        kind, _, extra = rest.partition(":")
        if not name or kind not in KINDS:
            raise ValueError(f"peer {spec!r}: write NAME=KIND[:ARGS] with KIND one of {', '.join(KINDS)}")
        tokens = shlex.split(extra)
        env = {}
        while tokens and _ENV_TOKEN.match(tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env[key] = value
        return cls(name, kind, tuple(tokens), env)

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return " ".join(filter(None, [self.kind, env, " ".join(self.args)]))

    def command(self, model_dir: str, port: int, vllm_venv: Path) -> tuple[list[str], dict[str, str]]:
        """(argv, environment) that start this peer's server on 127.0.0.1:`port`."""
        env = dict(os.environ)
        if self.kind == "mmserve":
            argv = [
                sys.executable,
                "-m",
                "mmserve.cli",
                "serve",
                model_dir,
                "--log-level",
                "warning",
            ]
        elif self.kind == "hf":
            argv = [sys.executable, "-m", "mmserve.bench.hf_server", model_dir]
        else:
            argv = [str(vllm_venv / "bin" / "vllm"), "serve", model_dir, "--host", "127.0.0.1"]
            env |= _VLLM_ENV
            if self.kind == "vllm-tuned":
                env |= {
                    "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    "LD_PRELOAD": f"{_TCMALLOC}:{vllm_venv / 'lib' / 'libiomp5.so'}",
                }
        return [*argv, "--port", str(port), *self.args], env | self.env


class RunningServer:
    """A peer's server process group; `stop()` ends that group and nothing else."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        self.proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Children that outlived the leader (e.g. an engine process) are still in the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
