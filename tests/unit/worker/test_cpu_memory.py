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

# Eight "layers" of a model on one thread: each makes a [3,072, 4,096] float32 activation (48 MiB,
# over glibc's largest mmap threshold, so unkept it is a fresh mmap every time) and a GELU of it;
# prints the minor page faults of the eight, after three to warm up. Unkept, each layer's two
# activations come back from the kernel zeroed: ~196,000 faults. Kept, the heap may still grow
# by an activation or two (a freed block followed by a small allocation is too short for an
# aligned request of its own size until its neighbours are freed too): 12,288 faults each.
PROBE = """
import json, resource, sys
import torch
from mmserve.worker.cpu_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
torch.set_num_threads(1)
x = torch.randn(3072, 64)
w = torch.randn(64, 4096)
def layer():
    hidden = torch.nn.functional.gelu(x @ w)
    return (hidden @ w.T).sum()
for _ in range(3):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    layer()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not user_tunes_malloc({k: v})}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_activations_are_reused_without_new_page_faults():
    unkept, kept = probe("default"), probe("keep")
    activation_pages = (48 << 20) // 4096
    assert unkept["faults"] > 8 * 2 * activation_pages * 0.9  # every activation zeroed anew
    assert kept["kept"] is True
    assert kept["faults"] < 3 * activation_pages  # the same pages, reused


def test_the_users_malloc_settings_are_left_alone():
    assert probe("keep", MALLOC_ARENA_MAX="2")["kept"] is False
    assert probe("keep", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")["kept"] is False
    assert not user_tunes_malloc({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"})
    assert user_tunes_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
