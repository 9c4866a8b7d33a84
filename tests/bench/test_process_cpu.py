"""The side-by-side benchmark's CPU accounting: a server's processes found by group and named."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmserve.bench.process_cpu import cpu_between, group_cpu_seconds

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")

_BURN = """
import time
from mmserve.process_name import set_process_name
set_process_name("mmserve-burner-long-name")
print(open("/proc/self/comm").read().strip(), flush=True)
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
time.sleep(30)
"""


def test_named_process_group_cpu_is_counted_and_others_are_not():
    child = subprocess.Popen(
        [sys.executable, "-c", _BURN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert child.stdout.readline().strip() == "mmserve-burner-"  # the kernel keeps 15 bytes
        deadline = time.monotonic() + 20
        spent = {}
        while time.monotonic() < deadline and spent.get("mmserve-burner-", 0) < 0.3:
            spent = group_cpu_seconds(child.pid)
            time.sleep(0.05)
        assert spent.get("mmserve-burner-", 0) >= 0.3
        assert set(spent) == {"mmserve-burner-"}  # this test's own process is another group
        later = group_cpu_seconds(child.pid)
        assert 0 <= cpu_between(spent, later)["mmserve-burner-"] < 0.2  # asleep now
    finally:
        child.kill()
        child.wait()
    assert group_cpu_seconds(child.pid) == {}
