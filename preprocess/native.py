"""Builds and loads the preprocessing kernels of `csrc/preprocess/` as a plain shared library.

They are C++ behind a C ABI, called through ctypes: the preprocessing workers import neither
torch nor mmserve (so they start fast and stay small), which rules out torch's extension loader
that `mmserve/ops` uses. The library is compiled on first use by the machine's C++ compiler
(`$CXX`, else `c++`) for this CPU (`-march=native`) into
`$MMSERVE_CACHE_DIR/preprocess_kernels/<key>/`, where the key hashes the sources, the compiler's
version, the flags and the CPU's feature flags; a file lock makes concurrent first uses (several
workers starting at once) build once. `-ffp-contract=off` keeps every double operation rounded
as written, which the resize kernel's bit-exactness with Pillow relies on.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger("preprocess")

SOURCE_DIR = Path(__file__).resolve().parents[1] / "csrc" / "preprocess"
CXX_FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
MARCH = "native"
_LIBRARY = "libmmserve_preprocess.so"
_ERROR_TAIL_LINES = 30

K = TypeVar("K")  # a kernel wrapper


class NativeBuildError(RuntimeError):
    """The preprocessing kernels could not be compiled or loaded; the message says why."""


def cache_root() -> Path:
    """`$MMSERVE_CACHE_DIR/preprocess_kernels` (default `~/.cache/mmserve`, as mmserve's own)."""
    base = os.environ.get("MMSERVE_CACHE_DIR", str(Path.home() / ".cache" / "mmserve"))
    return Path(base) / "preprocess_kernels"


def compiler() -> str:
    """The C++ compiler: `$CXX`, else `c++`, as found on PATH."""
    found = shutil.which(os.environ.get("CXX", "c++"))
    if found is None:
        raise NativeBuildError(f"no C++ compiler found (looked for {os.environ.get('CXX', 'c++')!r})")
    return found


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "flags":
                return value.strip()
    return ""


def build_key(compiler_path: str) -> str:
    """Hash of what the library depends on: sources, compiler version, flags and CPU."""
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.glob("*.cpp")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{version}\0{CXX_FLAGS}\0{MARCH}\0{_cpu_flags()}".encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_library(compiler_path: str, library: Path, march: str = MARCH) -> None:
    """Compile the sources into `library` for `-march={march}` (tests build other targets)."""
    sources = [str(path) for path in sorted(SOURCE_DIR.glob("*.cpp"))]
    if not sources:
        raise NativeBuildError(f"no C++ sources in {SOURCE_DIR} (they ship with the source tree)")
    partial = library.with_suffix(".partial")
    command = [compiler_path, *CXX_FLAGS, f"-march={march}", "-o", str(partial), *sources]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-_ERROR_TAIL_LINES:])
        raise NativeBuildError(f"building the preprocessing kernels failed ({' '.join(command)}):\n{tail}")
    partial.rename(library)  # atomic: a library on disk is always a whole one


def load() -> ctypes.CDLL:
    """Build (once per machine and source version) and load the library.

    Raises NativeBuildError when there is no compiler or the build fails."""
    compiler_path = compiler()
    key = build_key(compiler_path)
    root = cache_root()
    library = root / key / _LIBRARY
    with _file_lock(root / f"{key}.lock"):
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            logger.info("building the preprocessing kernels in %s (once per machine)", library.parent)
            compile_library(compiler_path, library)
    try:
        return ctypes.CDLL(str(library))
    except OSError as error:
        raise NativeBuildError(f"loading {library} failed: {error}") from None


def checked_kernel(
    make: Callable[[], K], agrees: Callable[[K], bool], fallback: str, mismatch: str
) -> K | None:
    """`make()` (a wrapper around `load()`) if it builds and `agrees` with its reference; else
    None, after one warning: `fallback` (what does the work instead) and why — the build error,
    or `mismatch`."""
    try:
        candidate = make()
    except NativeBuildError as error:
        logger.warning("%s (slower, same pixels): %s", fallback, error)
        return None
    if not agrees(candidate):
        logger.warning("%s (slower, same pixels): %s", fallback, mismatch)
        return None
    return candidate
