"""Videos in prompts: what a client may send, how its frames are sampled, and the placeholder
tokens each family expects.

A chat part `{"type": "video_url", "video_url": {"url": ...}}` names container bytes (data URL,
allowed file, allowed host), sampled by `num_frames` or `fps` (the server's --media-io-kwargs,
overridden per request by `mm_processor_kwargs`); offline, `multi_modal_data={"video": frames}`
gives frames (PIL images or a [T, H, W, 3] uint8 array, optionally as `(frames, {"fps": ...})`)
that are used as given.

Qwen2-VL and Qwen2.5-VL expand a video's `<|video_pad|>` into one run of placeholders (one
feature); Qwen3-VL into one `<t seconds><|vision_start|>pads<|vision_end|>` group per temporal
patch, each group a feature of its own, as transformers' processor lays it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from mmserve.frontend.media import RawDataUrl
from mmserve.protocol import MultiModalFeature
from preprocess import FrameSampling, ProcessedImage, VideoSettings, VideoSource

VIDEO_PAD = "<|video_pad|>"
ASSUMED_FPS = 24.0  # what transformers assumes for frames given without a rate


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


def pool_input(video: VideoData, settings: VideoSettings, sampling: FrameSampling) -> VideoSource:
    if video.frames is not None:
        return VideoSource.from_frames(video.frames, settings, fps=video.fps)
    return VideoSource(settings, video.data, sampling=sampling)


def sampled_fps(processed: ProcessedImage) -> float:
    """Frames per second of the sampled frames (transformers' `VideoMetadata.sampled_fps`)."""
    info = processed.video_info
    if info.fps is None:
        return ASSUMED_FPS
    return len(info.frames_indices) / info.total_num_frames * info.fps


def frame_timestamps(processed: ProcessedImage, temporal_patch_size: int) -> list[float]:
    """Seconds at the middle of each temporal patch (the last one padded with its last frame)."""
    info = processed.video_info
    fps = info.fps or ASSUMED_FPS
    indices = list(info.frames_indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)
    ]


@dataclass(frozen=True)
class VideoTokens:
    """What expanding a video needs from the tokenizer and the model."""

    family: str
    pad_id: int
    vision_start_id: int
    vision_end_id: int
    temporal_patch_size: int
    encode: Any  # text → token ids

    def expand(
        self, processed: ProcessedImage, offset: int
    ) -> tuple[list[int], list[MultiModalFeature], dict[str, np.ndarray]]:
        """The token ids replacing one `<|video_pad|>` at `offset`, the video's features, and
        their pixels (copied out of the pool) by mm_hash."""
        pixels = np.array(processed.pixel_values)
        grid_t, gh, gw = processed.grid_thw
        feature = MultiModalFeature(
            processed.mm_hash, offset, processed.num_tokens, (grid_t, gh, gw), modality="video"
        )
        if self.family != "qwen3_vl":
            seconds = self.temporal_patch_size / sampled_fps(processed)
            return (
                [self.pad_id] * processed.num_tokens,
                [replace(feature, seconds_per_temporal_patch=seconds)],
                {feature.mm_hash: pixels},
            )
        per_frame = processed.num_tokens // grid_t
        tokens: list[int] = []
        features = []
        for index, seconds in enumerate(frame_timestamps(processed, self.temporal_patch_size)):
            tokens += [*self.encode(f"<{seconds:.1f} seconds>"), self.vision_start_id]
            features.append(
                replace(
                    feature,
                    mm_hash=f"{processed.mm_hash}-{index}",
                    offset=offset + len(tokens),
                    length=per_frame,
                    grid_thw=(1, gh, gw),
                )
            )
            tokens += [self.pad_id] * per_frame + [self.vision_end_id]
        frame_pixels = {f.mm_hash: pixels[i * gh * gw : (i + 1) * gh * gw] for i, f in enumerate(features)}
        return tokens, features, frame_pixels


@dataclass(frozen=True)
class VideoSupport:
    """Everything the input processor needs for videos of one model."""

    settings: VideoSettings
    tokens: VideoTokens
    limit: int  # videos per prompt
    default_sampling: FrameSampling  # the server's (--media-io-kwargs), else the processor's
