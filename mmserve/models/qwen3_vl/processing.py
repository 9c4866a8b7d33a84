"""How Qwen3-VL prompts carry videos: one `<t seconds><|vision_start|>pads<|vision_end|>` group
per temporal patch (the first group's vision tokens are the template's), each group a feature of
its own with the patch's pixel rows, as transformers' processor lays it out. Images as Qwen2-VL.
Imports no torch."""

from __future__ import annotations

from mmserve.models.family import Expansion, Placement, ProcessedItem
from mmserve.models.qwen2_vl.processing import ASSUMED_FPS, QwenVLProcessor


class Qwen3VLProcessor(QwenVLProcessor):
    clip_bound_video = True  # the video processor bounds the whole clip's pixels

    def expand_video(self, item: ProcessedItem) -> Expansion:
        grid_t, gh, gw = item.grid_thw
        per_frame = item.num_tokens // grid_t
        tokens: list[int] = []
        placements = []
        temporal = self.video_settings.temporal_patch_size
        for index, seconds in enumerate(frame_timestamps(item, temporal)):
            tokens += [*self.tokens.encode(f"<{seconds:.1f} seconds>"), self.config.vision_start_token_id]
            rows = (index * gh * gw, (index + 1) * gh * gw)
            placements.append(Placement(len(tokens), per_frame, (1, gh, gw), rows=rows, part=index))
            tokens += [self.video_placeholder_id] * per_frame + [self.config.vision_end_token_id]
        return Expansion(tokens, placements)


def frame_timestamps(item: ProcessedItem, temporal_patch_size: int) -> list[float]:
    """Seconds at the middle of each temporal patch (the last one padded with its last frame)."""
    info = item.video_info
    fps = info.fps or ASSUMED_FPS
    indices = list(info.frames_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)
    ]
