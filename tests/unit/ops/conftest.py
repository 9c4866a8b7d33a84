"""The kernels' tests run twice where a threshold decides their threading: with the default
(small shapes then run on one thread) and with every region parallel, so that the split and
merge paths are checked at shapes small enough to test many of."""

from __future__ import annotations

import pytest

from mmserve.ops import cpu


@pytest.fixture(params=["default threshold", "every region parallel"])
def parallel_threshold(request):
    if request.param == "default threshold" or not cpu.is_available():
        yield request.param
        return
    before = cpu.set_min_parallel_work(0)
    try:
        yield request.param
    finally:
        cpu.set_min_parallel_work(before)


@pytest.fixture(params=["AMX tiles as built", "AMX tiles off"])
def amx_tiles(request):
    """bfloat16 kernel tests run twice in an AMX build: on the tiles, and with them off
    (`cpu.set_amx_tiles`) on the vdpbf16ps kernels that AVX512-BF16 CPUs without AMX run (Zen 4;
    bit for bit those of their own build), so one machine and one build check both. Elsewhere
    the second run would repeat the first: skipped."""
    if request.param == "AMX tiles as built":
        yield request.param
        return
    if not cpu.is_available() or not cpu.amx_tiles():
        pytest.skip("no AMX tiles in this build to turn off")
    cpu.set_amx_tiles(False)
    try:
        yield request.param
    finally:
        cpu.set_amx_tiles(True)
