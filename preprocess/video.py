"""Videos: which frames are sampled, and the path from container bytes (or given frames) through
the settings' `VideoTransform` to `pixel_values`.

Frames are sampled here rather than by the processor (as vLLM's video loader does): `num_frames`
evenly spaced frames from first to last, or `fps` frames per second of video, never more than the
video has or `max_frames`. A list of frames from the offline API is used as given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

from preprocess.errors import EmptyVideo
from preprocess.transform import GridTHW, VideoTransform
from preprocess.video_decode import check_decode_cost, decode_frames, probe_video

DEFAULT_NUM_FRAMES = 32  # vLLM's default when neither num_frames nor fps is set


@dataclass(frozen=True)
class FrameSampling:
    """How many frames to take: `num_frames`, else `fps` per second of video (not both)."""

    num_frames: int | None = None
    fps: float | None = None

    def __post_init__(self) -> None:
        if self.num_frames is not None and self.fps is not None:
            raise ValueError("num_frames and fps are mutually exclusive")
        if self.num_frames is not None and self.num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {self.num_frames}")
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f"fps must be > 0, got {self.fps}")


@dataclass(frozen=True)
class VideoInfo:
    """What the prompt needs besides the grid: which frames were taken, at what rate."""

    frames_indices: tuple[int, ...]
    fps: float | None  # the video's frame rate; None for frames given without one
    total_num_frames: int


@dataclass(frozen=True)
class VideoSource:
    """A video to process: container bytes to sample with `sampling`, or RGB frames
    [T, H, W, 3] uint8 (as bytes, with their shape) used as given, with an optional fps."""

    settings: VideoTransform
    data: bytes = b""
    frames_shape: tuple[int, int, int, int] | None = None
    fps: float | None = None
    sampling: FrameSampling = FrameSampling()

    @classmethod
    def from_frames(
        cls, frames: np.ndarray, settings: VideoTransform, fps: float | None = None
    ) -> VideoSource:
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise EmptyVideo(f"video frames must be [T, H, W, 3] uint8, got {frames.dtype} {frames.shape}")
        if frames.shape[0] == 0:
            raise EmptyVideo("the video has no frames")
        return cls(settings, np.ascontiguousarray(frames).tobytes(), tuple(frames.shape), fps)

    def digest(self) -> str:
        """The mm_hash: input, sampling and settings (the same bytes sampled differently differ)."""
        hasher = xxhash.xxh3_128()
        hasher.update(self.settings.digest)
        header = ("frames", self.frames_shape, self.fps) if self.frames_shape else ("encoded", self.sampling)
        hasher.update(b"video\0" + repr(header).encode() + b"\0")
        hasher.update(self.data)
        return hasher.hexdigest()


def sample_indices(
    total: int, video_fps: float | None, sampling: FrameSampling, settings: VideoTransform
) -> np.ndarray:
    """Indices of the frames to take from a video of `total` frames: evenly spaced, first and
    last included."""
    if sampling.num_frames is not None:
        count = sampling.num_frames
    elif sampling.fps is not None:
        count = max(1, math.floor(total / (video_fps or 24) * sampling.fps))
    elif settings.default_fps is not None and settings.default_num_frames is None:
        count = max(1, math.floor(total / (video_fps or 24) * settings.default_fps))
    else:
        count = settings.default_num_frames or DEFAULT_NUM_FRAMES
    count = min(count, total, settings.max_frames)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def video_pixel_values_nbytes(grid: GridTHW, settings: VideoTransform) -> int:
    rows, columns = settings.pixel_values_shape(grid)
    return rows * columns * 4  # float32


@dataclass(frozen=True)
class VideoPlan:
    """What processing will make, known from the header: the grid and the frames to take."""

    grid: GridTHW
    info: VideoInfo
    decode: bool  # the frames come from container bytes (else they were given)


def plan(source: VideoSource) -> VideoPlan:
    """Raises the `VideoError`s the header shows (format, size, frame count, decoding cost)."""
    settings = source.settings
    if source.frames_shape is not None:
        num_frames, height, width, _ = source.frames_shape
        info = VideoInfo(tuple(range(num_frames)), source.fps, num_frames)
        return VideoPlan(settings.grid(num_frames, height, width), info, decode=False)
    header = probe_video(source.data, settings)
    indices = sample_indices(header.num_frames, header.fps, source.sampling, settings)
    check_decode_cost(header, int(indices[-1]), settings)
    info = VideoInfo(tuple(indices.tolist()), header.fps, header.num_frames)
    return VideoPlan(settings.grid(len(indices), header.height, header.width), info, decode=True)


def process_video(
    source: VideoSource, allocate: Callable[[tuple[int, int]], np.ndarray]
) -> tuple[GridTHW, VideoInfo]:
    """Decode (if bytes), resize, normalise and patchify into a float32 array from `allocate`."""
    video = plan(source)
    if video.decode:
        frames = decode_frames(source.data, np.asarray(video.info.frames_indices), source.settings)
    else:
        frames = np.frombuffer(source.data, dtype=np.uint8).reshape(source.frames_shape)
    grid = video.grid
    out = allocate(source.settings.pixel_values_shape(grid))
    source.settings.patchify(frames, grid, out)
    return grid, video.info
