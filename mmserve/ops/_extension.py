"""Builds and loads the C++ CPU kernels of `csrc/`: the only importer of the compiled library.

The library is compiled on first use with the machine's C++ compiler and ninja
(`torch.utils.cpp_extension.load`) for the vector instructions this CPU has, into
`<cache_dir>/cpu_kernels/<key>/`, where the key hashes the sources, the torch version and the
build target. A file lock makes concurrent first uses build once; later processes load the
finished library without invoking the compiler. The kernels register as `torch.ops.mmserve_cpu`.

The build target is the vector ISA torch itself dispatches to (`torch.backends.cpu.
get_cpu_capability()`: AVX512, AVX2 or DEFAULT, which honours `ATEN_CPU_CAPABILITY`), compiled
with the matching explicit `-m` flags and ATen's `CPU_CAPABILITY_*` macros so `at::vec` picks
the same code path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mmserve import envs, host_cpu

logger = logging.getLogger("mmserve.ops")

SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc"
_FLAGS_BY_CAPABILITY = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
    "DEFAULT": (),
}
_ERROR_TAIL_LINES = 40


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded; the message ends with the compiler output."""


@dataclass(frozen=True)
class BuildTarget:
    capability: str  # AVX512 | AVX2 | DEFAULT: the at::vec code path compiled in
    cflags: tuple[str, ...]
    cpu_flags: str  # the "flags" line of /proc/cpuinfo, part of the cache key


def build_target() -> BuildTarget:
    """The vector ISA to compile for: torch's own dispatch choice, DEFAULT when it is none we know."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _FLAGS_BY_CAPABILITY:
        capability = "DEFAULT"
    macros = [f"-DCPU_CAPABILITY={capability}"]
    if capability != "DEFAULT":
        macros.append(f"-DCPU_CAPABILITY_{capability}")
    flags = host_cpu.flags()
    if capability == "AVX512" and "avx512_bf16" in flags.split():
        macros += ["-DMMSERVE_BF16_DOT", "-mavx512bf16"]  # vdpbf16ps: linear.cpp, varlen_attention_dot.cpp
        if "amx_bf16" in flags.split():
            macros += ["-DMMSERVE_AMX", "-mamx-tile", "-mamx-bf16"]  # tdpbf16ps: linear_amx.h
    cflags = ("-O3", "-fopenmp", *macros, *_FLAGS_BY_CAPABILITY[capability])
    return BuildTarget(capability, cflags, flags)


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


def build_key(target: BuildTarget) -> str:
    """Hash of everything the library depends on: sources, headers, torch, target and CPU."""
    digest = hashlib.sha256()
    for path in sorted([*SOURCE_DIR.glob("*.cpp"), *SOURCE_DIR.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{torch.__version__}\0{target.cflags}\0{target.cpu_flags}".encode())
    return f"{target.capability.lower()}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock the kernel releases when the holder dies (unlike torch's FileBaton)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Puts the `ninja` Python package's binary on PATH when no system ninja is found."""
    if shutil.which("ninja") is not None:
        yield
        return
    try:
        import ninja
    except ImportError:
        yield
        return
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old_path
    try:
        yield
    finally:
        os.environ["PATH"] = old_path


def _compile(target: BuildTarget, build_dir: Path, name: str) -> None:
    from torch.utils import cpp_extension

    # A torch lock file left by a killed build would make torch wait forever; we hold the lock.
    (build_dir / "lock").unlink(missing_ok=True)
    logger.info("building the CPU kernels for %s in %s (once per machine)", target.capability, build_dir)
    start = time.perf_counter()
    try:
        with _ninja_on_path():
            cpp_extension.load(
                name=name,
                sources=[str(path) for path in sources()],
                extra_cflags=list(target.cflags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError) as error:
        tail = "\n".join(str(error).splitlines()[-_ERROR_TAIL_LINES:])
        raise KernelBuildError(f"building the CPU kernels in {build_dir} failed:\n{tail}") from error
    logger.info("built the CPU kernels in %.1f s", time.perf_counter() - start)


def _build_and_load() -> None:
    if not sources():
        raise KernelBuildError(f"no C++ sources in {SOURCE_DIR} (the CPU kernels ship with the source tree)")
    target = build_target()
    key = build_key(target)
    root = envs.cache_dir() / "cpu_kernels"
    build_dir = root / key
    # The name carries the key: torch renames a library rebuilt under a used name in one process.
    name = "mmserve_cpu_" + key.replace("-", "_")
    library = build_dir / f"{name}.so"
    done = build_dir / "complete"
    with _file_lock(root / f"{key}.lock"):
        if done.exists() and library.exists():
            torch.ops.load_library(str(library))
            return
        build_dir.mkdir(parents=True, exist_ok=True)
        _compile(target, build_dir, name)  # loads the library too
        done.write_text(f"{target.capability} {torch.__version__}\n")


_lock = threading.Lock()
_loaded: torch._ops._OpNamespace | None = None
_error: KernelBuildError | None = None


def ops() -> torch._ops._OpNamespace:
    """`torch.ops.mmserve_cpu`, building and loading the library on the first call.

    Raises KernelBuildError (the same one on every later call) when it cannot be built."""
    global _loaded, _error
    if _loaded is not None:  # the per-call path: no lock
        return _loaded
    with _lock:
        if _error is not None:
            raise _error
        if _loaded is None:
            try:
                _build_and_load()
            except KernelBuildError as error:
                _error = error
                raise
            _loaded = torch.ops.mmserve_cpu
    return _loaded


def is_available() -> bool:
    """Whether the CPU kernels can be used here: builds them on the first call (once per machine,
    about a minute), then answers from memory. For callers that fall back to torch."""
    try:
        ops()
    except KernelBuildError as error:
        logger.warning("CPU kernels unavailable, using the torch path: %s", str(error).splitlines()[0])
        return False
    return True
