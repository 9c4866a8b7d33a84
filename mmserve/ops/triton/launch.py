"""A kernel launch planned on the host, kept apart from running it.

Wrappers build `Launch`es from tensor shapes and host-side ints only (no device sync), then run
them. The split lets the sm_90 compile test build the very launches a wrapper would start and
compile them ahead of time on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Launch:
    """`kernel[grid](**args, num_warps=num_warps)`; an empty grid launches nothing."""

    kernel: Any  # a triton JITFunction (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4

    def run(self) -> None:
        if all(size > 0 for size in self.grid):
            self.kernel[self.grid](**self.args, num_warps=self.num_warps)


def next_power_of_two(n: int) -> int:
    """The smallest power of two ≥ n (n ≥ 1): the padded extent of a `tl.arange` tile."""
    return 1 << (n - 1).bit_length()


def dot_extent(n: int) -> int:
    """Padded extent of a `tl.dot` operand dimension: a power of two, and at least the 16 the
    tensor-core instructions need."""
    return max(16, next_power_of_two(n))
