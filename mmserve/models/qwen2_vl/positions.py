"""M-RoPE positions of a Qwen-VL prompt: three position ids per token (temporal, height, width).

Text tokens carry the same id in all three; an item's tokens carry (t, row, col) offsets from the
position where the item starts, and the text after an item resumes at start + max(rows, cols).
Generated tokens continue at their index plus a delta that the prompt's items decide.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmserve.models.family import PromptPositions
from mmserve.protocol import MultiModalFeature


class MRopePositions(PromptPositions):
    rows = 3

    def __init__(self, spatial_merge_size: int) -> None:
        self.spatial_merge_size = spatial_merge_size

    def of_prompt(
        self, num_prompt_tokens: int, features: Sequence[MultiModalFeature]
    ) -> tuple[np.ndarray | None, int]:
        items = [(f.offset, f.length, f.grid_thw) for f in features]
        steps = [f.position_step for f in features]
        return mrope_input_positions(num_prompt_tokens, items, self.spatial_merge_size, steps)


def mrope_input_positions(
    num_tokens: int,
    items: Sequence[tuple[int, int, tuple[int, int, int]]],
    spatial_merge_size: int,
    time_intervals: Sequence[float] | None = None,
) -> tuple[np.ndarray, int]:
    """M-RoPE positions of a prompt and the delta that continues them for generated tokens.

    items: (offset of the first placeholder token, number of placeholder tokens, (t, h, w) patch
    grid) per image or video, in prompt order. `time_intervals` (one per item, default 1) spaces
    the temporal positions of a video: temporal patch i sits at ⌊i · interval⌋ computed in
    float32, as transformers does for Qwen2.5-VL. Returns positions [3, num_tokens] int64 and
    `delta` such that the token at index i ≥ num_tokens has position i + delta in all three rows.
    """
    positions = np.empty((3, num_tokens), dtype=np.int64)
    next_pos = 0
    text_start = 0
    intervals = time_intervals if time_intervals is not None else [1.0] * len(items)
    for (offset, length, (t, h, w)), interval in zip(items, intervals, strict=True):
        text_len = offset - text_start
        positions[:, text_start:offset] = next_pos + np.arange(text_len)
        next_pos += text_len
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        if t * rows * cols != length:
            raise ValueError(
                f"image at {offset} has {length} placeholder tokens but its grid gives {t * rows * cols}"
            )
        temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(temporal, np.arange(rows), np.arange(cols), indexing="ij")
        positions[:, offset : offset + length] = next_pos + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        next_pos += max(rows, cols)
        text_start = offset + length
    positions[:, text_start:] = next_pos + np.arange(num_tokens - text_start)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
