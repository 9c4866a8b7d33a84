"""The engine's malloc keeps freed memory (mmserve.worker.cpu_memory): a large block freed and
allocated again comes back without the kernel zeroing its pages a second time. Each case runs in
a fresh interpreter, since the setting is for the whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mmserve.worker.cpu_memory import user_tunes_malloc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Allocates a 64 MiB tensor and writes it whole, frees it, and does it again; prints the minor
# page faults of the second round. Unkept, the block is a fresh mmap each time: 16,384 faults.
PROBE = """
import json, resource, sys
import torch
from mmserve.worker.cpu_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
def touch():
    block = torch.empty(64 << 20, dtype=torch.uint8)
    block.fill_(1)
    del block
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not user_tunes_malloc({k: v})}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_new_page_faults():
    unkept, kept = probe("default"), probe("keep")
    assert unkept["faults"] > 8_000  # the 64 MiB came back from the kernel, zeroed again
    assert kept["kept"] is True
    assert kept["faults"] < 500  # the same pages, reused


def test_the_users_malloc_settings_are_left_alone():
    assert probe("keep", MALLOC_ARENA_MAX="2")["kept"] is False
    assert probe("keep", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")["kept"] is False
    assert not user_tunes_malloc({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"})
    assert user_tunes_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
