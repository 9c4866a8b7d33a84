"""Videos: which frames are sampled, and the pure transforms from RGB frames to `pixel_values`.

The result equals transformers' Qwen video processors (`Qwen2VLVideoProcessor` for Qwen2-VL and
Qwen2.5-VL, `Qwen3VLVideoProcessor`) given the same frames: the resize is the same antialiased
bicubic on uint8 that torchvision's tensor path calls (torch's own kernel), the normalisation is
the same float32 arithmetic, and patches are laid out as theirs, with the last frame repeated
up to a whole temporal patch.

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
from preprocess.image import GridTHW, check_aspect_ratio, smart_resize
from preprocess.video_decode import check_decode_cost, decode_frames, probe_video
from preprocess.video_settings import VideoSettings

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

    settings: VideoSettings
    data: bytes = b""
    frames_shape: tuple[int, int, int, int] | None = None
    fps: float | None = None
    sampling: FrameSampling = FrameSampling()

    @classmethod
    def from_frames(
        cls, frames: np.ndarray, settings: VideoSettings, fps: float | None = None
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
    total: int, video_fps: float | None, sampling: FrameSampling, settings: VideoSettings
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


def resized_size(num_frames: int, height: int, width: int, settings: VideoSettings) -> tuple[int, int]:
    """Target (height, width) of every frame, as the family's video processor computes it."""
    if settings.family != "qwen3_vl":
        return smart_resize(height, width, settings)  # each frame on its own, like an image
    temporal = settings.temporal_patch_size
    if num_frames < temporal:
        raise EmptyVideo(f"this model needs at least {temporal} video frames, got {num_frames}")
    factor = settings.factor
    if height < factor or width < factor:  # Qwen3-VL lifts frames smaller than one token
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    check_aspect_ratio(height, width)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > settings.max_pixels:
        beta = math.sqrt(num_frames * height * width / settings.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < settings.min_pixels:
        beta = math.sqrt(settings.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_grid(num_frames: int, height: int, width: int, settings: VideoSettings) -> GridTHW:
    """`video_grid_thw`: temporal patches (the last one padded) and the patch grid of a frame."""
    resized_h, resized_w = resized_size(num_frames, height, width, settings)
    grid_t = -(-num_frames // settings.temporal_patch_size)
    return grid_t, resized_h // settings.patch_size, resized_w // settings.patch_size


def video_pixel_values_nbytes(grid: GridTHW, settings: VideoSettings) -> int:
    return grid[0] * grid[1] * grid[2] * settings.patch_dim * 4  # float32


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
        return VideoPlan(video_grid(num_frames, height, width, settings), info, decode=False)
    header = probe_video(source.data, settings)
    indices = sample_indices(header.num_frames, header.fps, source.sampling, settings)
    check_decode_cost(header, int(indices[-1]), settings)
    info = VideoInfo(tuple(indices.tolist()), header.fps, header.num_frames)
    return VideoPlan(video_grid(len(indices), header.height, header.width, settings), info, decode=True)


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
    out = allocate((grid[0] * grid[1] * grid[2], source.settings.patch_dim))
    patchify_video_into(frames, grid, source.settings, out)
    return grid, video.info


def patchify_video_into(frames: np.ndarray, grid: GridTHW, settings: VideoSettings, out: np.ndarray) -> None:
    """frames [T, H, W, 3] uint8 → `out` [grid_t·gh·gw, C·T·P·P] float32, rows in (t, block_h,
    block_w, merge_h, merge_w) order and columns in (C, T, P_h, P_w) order, as transformers."""
    import torch  # only the video path needs torch, for the same resize kernel as torchvision

    grid_t, gh, gw = grid
    p, m, tp = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    frames = np.require(frames, requirements="W")  # torch wants writable memory (copies if not)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
    if (video.shape[2], video.shape[3]) != (gh * p, gw * p):
        video = torch.nn.functional.interpolate(
            video, size=[gh * p, gw * p], mode="bicubic", align_corners=False, antialias=True
        )
    mean = torch.tensor(settings.image_mean) * (1.0 / settings.rescale_factor)
    std = torch.tensor(settings.image_std) * (1.0 / settings.rescale_factor)
    video = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    if pad := grid_t * tp - video.shape[0]:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    # [grid_t, tp, C, gh/m, m, p, gw/m, m, p] → [grid_t, gh/m, gw/m, m, m, C, tp, p, p]
    patches = video.view(grid_t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    torch.from_numpy(out).view(grid_t, gh // m, gw // m, m, m, 3, tp, p, p).copy_(patches)
