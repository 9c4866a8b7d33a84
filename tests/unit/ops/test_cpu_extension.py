"""Building and loading the C++ library: cache key, concurrent first use, failures, fallbacks.

Most tests build a one-line stand-in library from a temporary source folder (compiles in about
a second); the last builds the real kernels for the DEFAULT (scalar) target in a child process
and checks them against the references, as a CPU without AVX2 would run them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mmserve import host_cpu
from mmserve.ops import _extension

STAND_IN = 'extern "C" int mmserve_stand_in() { return 1; }\n'


@pytest.fixture
def sources(tmp_path, monkeypatch) -> Path:
    """A private source folder and cache dir for the build under test."""
    folder = tmp_path / "csrc"
    folder.mkdir()
    monkeypatch.setattr(_extension, "SOURCE_DIR", folder)
    monkeypatch.setenv("MMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_extension, "_loaded", None)
    monkeypatch.setattr(_extension, "_error", None)
    return folder


def test_cache_key_follows_sources_headers_torch_and_target(sources, monkeypatch):
    shutil.copytree(_extension.SOURCE_DIR, sources, dirs_exist_ok=True)
    (sources / "a.cpp").write_text(STAND_IN)
    (sources / "a.h").write_text("// v1\n")
    target = _extension.BuildTarget("AVX2", ("-mavx2",), "avx2 fma")
    key = _extension.build_key(target)
    assert _extension.build_key(target) == key
    (sources / "a.h").write_text("// v2\n")
    assert _extension.build_key(target) != key
    key = _extension.build_key(target)
    assert _extension.build_key(_extension.BuildTarget("AVX512", ("-mavx512f",), "avx2 fma")) != key
    assert _extension.build_key(_extension.BuildTarget("AVX2", ("-mavx2",), "avx2 fma avx512f")) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert _extension.build_key(target) != key


def test_target_matches_torchs_dispatch_capability():
    target = _extension.build_target()
    assert target.capability in {"AVX512", "AVX2", "DEFAULT"}
    assert f"-DCPU_CAPABILITY={target.capability}" in target.cflags
    if target.capability == "AVX2":
        assert {"-mavx2", "-mfma"} <= set(target.cflags)


def test_another_cpus_flags_and_vendor_for_the_build_and_the_path_choices(monkeypatch):
    """MMSERVE_CPU_FLAGS_OFF and MMSERVE_CPU_VENDOR make an AMX Xeon look like a Zen 4 to the
    build (no AMX in it) and to every choice that reads host_cpu.flags / vendor."""
    cpuinfo = {
        "flags": "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16",
        "vendor_id": "GenuineIntel",
    }
    monkeypatch.setattr(host_cpu, "info", lambda field: cpuinfo[field])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("MMSERVE_CPU_FLAGS_OFF", raising=False)  # as this process may run emulated
    monkeypatch.delenv("MMSERVE_CPU_VENDOR", raising=False)
    assert {"-DMMSERVE_BF16_DOT", "-DMMSERVE_AMX"} <= set(_extension.build_target().cflags)
    assert host_cpu.vendor() == "GenuineIntel"
    monkeypatch.setenv("MMSERVE_CPU_FLAGS_OFF", "amx_bf16,amx_tile avx512_fp16")
    monkeypatch.setenv("MMSERVE_CPU_VENDOR", "AuthenticAMD")
    assert host_cpu.flags() == "fpu avx2 avx512f avx512_bf16"
    assert host_cpu.vendor() == "AuthenticAMD"
    target = _extension.build_target()
    assert "-DMMSERVE_BF16_DOT" in target.cflags and "-DMMSERVE_AMX" not in target.cflags
    assert target.cpu_flags == "fpu avx2 avx512f avx512_bf16"  # and so its own cache key


def test_a_failed_build_raises_with_the_compiler_output_and_disables_the_kernels(sources):
    (sources / "broken.cpp").write_text("int broken( {\n")
    with pytest.raises(_extension.KernelBuildError, match=r"broken\.cpp") as error:
        _extension.ops()
    assert "error" in str(error.value)
    assert not _extension.is_available()
    with pytest.raises(_extension.KernelBuildError) as again:  # remembered, not rebuilt
        _extension.ops()
    assert again.value is error.value


def test_concurrent_first_uses_build_once_and_later_ones_only_load(sources, tmp_path):
    (sources / "stand_in.cpp").write_text(STAND_IN)
    script = textwrap.dedent(f"""
        import logging, sys
        from pathlib import Path
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from mmserve.ops import _extension
        _extension.SOURCE_DIR = Path({str(sources)!r})
        _extension._build_and_load()
        print("loaded")
    """)
    env = {**os.environ, "MMSERVE_CACHE_DIR": str(tmp_path / "cache")}
    run = lambda: subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    first = [run() for _ in range(3)]
    outputs = [process.communicate(timeout=300)[0] for process in first]
    assert all(process.returncode == 0 for process in first), outputs
    assert all("loaded" in output for output in outputs)
    assert sum(output.count("building the CPU kernels") for output in outputs) == 1
    later = run()
    output = later.communicate(timeout=300)[0]
    assert later.returncode == 0 and "building" not in output


def test_libraries_of_different_sources_build_and_load_in_one_process(sources, monkeypatch):
    """torch renames a second build under a used name; each key must still find its library."""
    (sources / "stand_in.cpp").write_text(STAND_IN)
    _extension._build_and_load()
    (sources / "stand_in.cpp").write_text(STAND_IN.replace("return 1", "return 2"))
    _extension._build_and_load()
    built = sorted(path.name for path in (sources.parent / "cache" / "cpu_kernels").glob("*/*.so"))
    assert len(built) == 2 and not any("_v1" in name for name in built)


@pytest.mark.slow
def test_scalar_build_for_cpus_without_avx2_matches_the_references():
    """ATEN_CPU_CAPABILITY=default makes torch, and so the build, use the DEFAULT target."""
    script = textwrap.dedent("""
        import torch
        from mmserve.ops import _extension, cpu, reference
        assert _extension.build_target().capability == "DEFAULT"
        torch.manual_seed(0)
        query = torch.randn(7, 8, 36)
        cache = torch.randn(2, 40, 16, 2, 36)
        starts = torch.tensor([0, 1, 7], dtype=torch.int32)
        lens = torch.tensor([300, 20], dtype=torch.int32)
        table = torch.randperm(40).int()[:38].view(2, 19)
        got = cpu.paged_attention(query, cache, starts, lens, table, 0.1)
        want = reference.paged_attention(query, cache, starts, lens, table, 0.1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        x, w = torch.randn(3, 100).bfloat16(), torch.randn(100).bfloat16()
        want = reference.rms_norm(x, w, 1e-6)
        torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), want, rtol=2**-7, atol=1e-5)
        x, w, b = torch.randn(7, 40).bfloat16(), torch.randn(21, 40).bfloat16(), torch.randn(21)
        got = cpu.packed_linear(x, cpu.pack_weight(w, torch.bfloat16), b, 21)
        torch.testing.assert_close(got, reference.linear(x, w, b), rtol=2**-7, atol=1e-4)
        print("ok")
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}  # the shared cache: built once per machine
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
