"""Videos from client bytes with PyAV: the header (size, frame count, frame rate) and the
sampled frames as RGB.

Everything a client can get wrong comes out as a `VideoError`: not a video, a container we do
not accept, no video stream, too many frames or pixels (checked from the header, before any
frame is decoded), frames that stop before the header said they would.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

from preprocess.errors import CorruptVideo, EmptyVideo, UnsupportedVideoFormat, VideoTooLarge
from preprocess.transform import VideoTransform


@dataclass(frozen=True)
class VideoHeader:
    width: int
    height: int
    num_frames: int  # counted from the demuxed packets where the header does not say
    fps: float | None  # the stream's average frame rate, None where unknown


def _open(data: bytes, settings: VideoTransform) -> av.container.InputContainer:
    if not data:
        raise UnsupportedVideoFormat("video data is empty")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (MemoryError, RecursionError):
        raise
    except EOFError:  # (av.EOFError is one) a header and nothing after it
        raise EmptyVideo("the video ends before its first frame (no frames, or truncated)") from None
    except Exception:  # PyAV raises FFmpegError subclasses, and others on odd input
        raise UnsupportedVideoFormat("not a video in a supported format (mp4, webm, gif)") from None
    if container.format.name not in settings.containers:
        container.close()
        raise UnsupportedVideoFormat(f"video container {container.format.name!r} is not supported")
    if not container.streams.video:
        container.close()
        raise UnsupportedVideoFormat("the file has no video stream")
    return container


def _count_frames(container: av.container.InputContainer, limit: int) -> int:
    """Packets of the first video stream (one per frame), demuxed without decoding; stops past
    `limit` (the caller refuses the video then)."""
    count = 0
    try:
        for packet in container.demux(video=0):
            if packet.size:
                count += 1
                if count > limit:
                    break
    except av.FFmpegError as exc:
        raise CorruptVideo(f"video data is truncated or corrupt: {exc}") from None
    return count


def probe_video(data: bytes, settings: VideoTransform) -> VideoHeader:
    """The header, checked against the limits; no frame is decoded."""
    container = _open(data, settings)
    try:
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise CorruptVideo(f"video frames have no size ({width}x{height})")
        if width * height > settings.max_frame_pixels:
            raise VideoTooLarge(
                f"video frames are {width}x{height}, more than the limit of "
                f"{settings.max_frame_pixels:,} pixels"
            )
        rate = stream.average_rate
        num_frames = stream.frames or _count_frames(container, settings.max_video_frames)
        if not stream.frames and container.duration and rate:
            _check_not_truncated(num_frames, container.duration / 1e6 * float(rate))
        if num_frames > settings.max_video_frames:
            raise VideoTooLarge(
                f"the video has {num_frames:,} frames, more than the limit of {settings.max_video_frames:,}"
            )
        if num_frames == 0:
            raise EmptyVideo("the video has no frames")
        return VideoHeader(width, height, int(num_frames), float(rate) if rate else None)
    finally:
        container.close()


def _check_not_truncated(num_frames: int, announced_frames: float) -> None:
    """Where frames were counted, the header's duration still says how many there should be."""
    if num_frames < announced_frames - 1.5:  # (a frame of rounding either way)
        raise CorruptVideo(
            f"the video is truncated: its header announces about {announced_frames:.0f} frames, "
            f"the data holds {num_frames}"
        )


def check_decode_cost(header: VideoHeader, last_index: int, settings: VideoTransform) -> None:
    """Frames are decoded in order up to the last sampled one: refuse what costs too much."""
    decoded = (last_index + 1) * header.width * header.height
    if decoded > settings.max_decoded_pixels:
        raise VideoTooLarge(
            f"sampling this video decodes {decoded:,} pixels, more than the limit of "
            f"{settings.max_decoded_pixels:,}; ask for fewer frames or send a shorter or smaller video"
        )


def decode_frames(data: bytes, indices: np.ndarray, settings: VideoTransform) -> np.ndarray:
    """RGB frames at `indices` (sorted, distinct or not): [len(indices), H, W, 3] uint8."""
    wanted = set(indices.tolist())
    last = int(indices[-1])
    taken: dict[int, np.ndarray] = {}
    container = _open(data, settings)
    try:
        for position, frame in enumerate(container.decode(video=0)):
            if position in wanted:
                taken[position] = frame.to_ndarray(format="rgb24")
            if position >= last:
                break
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:  # decoder errors come as FFmpegError, odd frames as ValueError
        raise CorruptVideo(f"video data is truncated or corrupt: {exc}") from None
    finally:
        container.close()
    if len(taken) < len(wanted):
        raise CorruptVideo(f"the video ends after {len(taken)} of the frames its header announces")
    frames = [taken[i] for i in indices.tolist()]
    if any(f.shape != frames[0].shape for f in frames):
        raise CorruptVideo("the video's frames change size")
    return np.stack(frames)
