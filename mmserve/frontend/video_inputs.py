"""Videos in prompts: what a client may send, and how its frames are sampled.

A chat part `{"type": "video_url", "video_url": {"url": ...}}` names container bytes (data URL,
allowed file, allowed host), sampled by `num_frames` or `fps` (the server's --media-io-kwargs,
overridden per request by `mm_processor_kwargs`); offline, `multi_modal_data={"video": frames}`
gives frames (PIL images or a [T, H, W, 3] uint8 array, optionally as `(frames, {"fps": ...})`)
that are used as given.

What a video's placeholder becomes in the prompt is its model family's business
(`MultiModalProcessor.expand_video`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmserve.frontend.media import RawDataUrl
from preprocess import FrameSampling, VideoSource, VideoTransform


class VideoArgumentError(ValueError):
    """A sampling option is invalid; the message is safe to show to the client."""


@dataclass(frozen=True)
class VideoRef:
    """A chat part's video URL, loaded after every part has been checked."""

    url: str | RawDataUrl  # a long data URL stays the request body's bytes (media.RawDataUrl)


@dataclass(frozen=True)
class VideoData:
    """A loaded video: container bytes, or frames given offline."""

    data: bytes = b""
    frames: np.ndarray | None = None  # [T, H, W, 3] uint8
    fps: float | None = None


def parse_sampling(options: dict[str, Any] | None, default: FrameSampling | None = None) -> FrameSampling:
    """`{"num_frames": N}` or `{"fps": F}` (vLLM's names) → FrameSampling; unknown keys refused."""
    if not options:
        return default or FrameSampling()
    if not isinstance(options, dict) or set(options) - {"num_frames", "fps"}:
        raise VideoArgumentError("video options are 'num_frames' (an integer) or 'fps' (a number)")
    num_frames, fps = options.get("num_frames"), options.get("fps")
    if num_frames is not None and (not isinstance(num_frames, int) or isinstance(num_frames, bool)):
        raise VideoArgumentError("num_frames must be an integer")
    if fps is not None and (
        not isinstance(fps, int | float) or isinstance(fps, bool) or not math.isfinite(fps)
    ):
        raise VideoArgumentError("fps must be a number")
    try:
        return FrameSampling(num_frames=num_frames, fps=None if fps is None else float(fps))
    except ValueError as e:
        raise VideoArgumentError(str(e)) from None


def offline_video(item: Any) -> VideoData:
    """`multi_modal_data["video"]` item → VideoData: frames as a list of PIL images or an array,
    or container bytes; a `(frames, {"fps": F})` pair gives their rate."""
    fps = None
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict):
        item, metadata = item
        fps = metadata.get("fps")
    if isinstance(item, bytes | bytearray):
        return VideoData(data=bytes(item))
    if isinstance(item, list) and item and all(isinstance(f, Image.Image) for f in item):
        item = np.stack([np.asarray(f.convert("RGB")) for f in item])
    if isinstance(item, np.ndarray) and item.ndim == 4 and item.shape[-1] == 3 and item.dtype == np.uint8:
        return VideoData(frames=item, fps=None if fps is None else float(fps))
    raise VideoArgumentError(
        "a video is a list of PIL images, a [T, H, W, 3] uint8 array, or container bytes"
    )


def pool_input(video: VideoData, settings: VideoTransform, sampling: FrameSampling) -> VideoSource:
    if video.frames is not None:
        return VideoSource.from_frames(video.frames, settings, fps=video.fps)
    return VideoSource(settings, video.data, sampling=sampling)


@dataclass(frozen=True)
class VideoSupport:
    """Everything the input processor needs for videos of one model (beside its family's
    processor, which lays a video out in the prompt)."""

    settings: VideoTransform  # the family's video transform
    limit: int  # videos per prompt
    default_sampling: FrameSampling  # the server's (--media-io-kwargs), else the processor's
