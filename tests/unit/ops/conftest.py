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
