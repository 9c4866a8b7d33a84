"""The video test cases shared by the tests and the reference-fixture script: clips of several
lengths, aspect ratios and containers, how frames are sampled from each, and the prompt."""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

from mmserve.testing.videos import Clip

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class VideoCase:
    name: str
    clip: Clip
    num_frames: int | None = None  # sampling; None with fps None: the frames are given offline
    fps: float | None = None
    question: str = "What happens in the video?"
    image_size: tuple[int, int] | None = None  # (width, height) of a picture before the video

    @property
    def offline_frames(self) -> bool:
        return self.num_frames is None and self.fps is None


VIDEO_CASES = (
    VideoCase("landscape_mp4_4_frames", Clip(96, 64, 12), num_frames=4),
    VideoCase("portrait_mp4_5_frames", Clip(64, 112, 20, seed=1), num_frames=5, question="Describe it."),
    VideoCase("wide_webm_by_fps", Clip(128, 72, 30, seed=2, container="webm"), fps=2.5),
    VideoCase("gif_all_7_frames", Clip(80, 60, 7, seed=3, container="gif"), num_frames=7),
    VideoCase("offline_frames", Clip(72, 72, 6, seed=4)),
    VideoCase("image_then_video", Clip(96, 64, 12, seed=5), num_frames=4, image_size=(120, 90)),
)
CASES_BY_NAME = {case.name: case for case in VIDEO_CASES}


def count_frames(data: bytes) -> tuple[int, float]:
    """(frames, average frame rate) of a clip, counting demuxed packets."""
    with av.open(io.BytesIO(data)) as container:
        rate = float(container.streams.video[0].average_rate)
        return sum(1 for packet in container.demux(video=0) if packet.size), rate


def reference_indices(case: VideoCase, data: bytes) -> tuple[int, np.ndarray]:
    """The sampling rule, stated independently of `preprocess`: `num_frames` (or duration × fps)
    frames evenly spaced from the first to the last, rounded to the nearest index."""
    total, rate = count_frames(data)
    count = case.num_frames if case.num_frames is not None else int(total / rate * case.fps)
    count = min(count, total)
    return total, np.linspace(0, total - 1, count).round().astype(np.int64)


def case_messages(case: VideoCase) -> list[dict]:
    """The case's conversation in template form (parts typed "image" / "video")."""
    parts = [{"type": "image"}] if case.image_size else []
    parts += [{"type": "video"}, {"type": "text", "text": case.question}]
    return [{"role": "user", "content": parts}]
