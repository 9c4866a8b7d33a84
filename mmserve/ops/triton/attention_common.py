"""What the attention kernels share: programs mapped onto a ragged batch, the online softmax.

Segment s (a request's query rows, or one image's patches) of a batch whose segments start at
starts[0] = 0 ≤ starts[1] ≤ … owns the programs [starts[s] // BLOCK + s, starts[s + 1] // BLOCK + s + 1).
That is at least ceil(len_s / BLOCK) programs per segment and at most `num_rows // BLOCK + num_segments`
in all, a grid size the host knows from shapes alone; programs past a segment's last block exit.
"""

from __future__ import annotations

import triton
import triton.language as tl


def num_block_programs(num_rows: int, num_segments: int, block: int) -> int:
    """Grid size that covers every block of every segment (an upper bound, no device sync);
    0 without segments, when every row is padding."""
    return num_rows // block + num_segments if num_segments else 0


@triton.jit
def locate_block(starts_ptr, num_segments, program, BLOCK: tl.constexpr):
    """→ (segment, block index inside it) of `program`: a binary search over `starts_ptr`
    for the last segment whose first program is ≤ `program`."""
    low = 0
    high = num_segments
    while low < high:
        middle = (low + high) // 2
        first_program = tl.load(starts_ptr + middle) // BLOCK + middle
        if first_program <= program:
            low = middle + 1
        else:
            high = middle
    segment = low - 1
    return segment, program - (tl.load(starts_ptr + segment) // BLOCK + segment)


@triton.jit
def softmax_step(scores, running_max, running_sum):
    """One online-softmax step over a tile of `scores` [M, N] (log2 units, -inf where masked).

    → (new max, new sum, probabilities [M, N], factor that rescales the old accumulator [M]).
    A row that has seen only masked scores keeps max -inf; it is shifted by 0 instead, so its
    probabilities and factor are 0 rather than NaN.
    """
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    probabilities = tl.exp2(scores - shift[:, None])
    factor = tl.exp2(running_max - shift)
    return new_max, running_sum * factor + tl.sum(probabilities, axis=1), probabilities, factor
