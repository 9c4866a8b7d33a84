"""Synthetic video clips, encoded with PyAV: moving, seeded content in mp4 (H.264), webm (VP8)
or gif, the same bytes on every run and every x86-64 machine (single-threaded encoders, fixed
seeds, x264 kept to its AVX2 code, bit-exact containers), so tests and the reference-fixture
script see the same clips.
"""

from __future__ import annotations

import io
import platform
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image

from mmserve.testing.reference import synthetic_image

_CODECS = {"mp4": ("mp4", "libx264"), "webm": ("webm", "libvpx"), "gif": ("gif", "gif")}
# x264's AVX-512 code (Sapphire Rapids) encoded the same frames into different bitstreams from one
# call to the next (measured: 10,602 / 10,600 / 10,605 bytes); capped at AVX2 it is repeatable and
# gives the bytes the AVX2-only machines give. Other architectures keep x264's own choice.
_X264_PARAMS = {"x264-params": "asm=AVX2"} if platform.machine() in ("x86_64", "AMD64") else {}
# The webm muxer writes a random segment UID unless told to be bit-exact.
_CONTAINER_OPTIONS = {"fflags": "+bitexact"}


@dataclass(frozen=True)
class Clip:
    """A clip to synthesise: frame size, length, rate, container and seed."""

    width: int
    height: int
    num_frames: int
    fps: int = 10
    container: str = "mp4"
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.container}-{self.width}x{self.height}-{self.num_frames}f-{self.fps}fps-s{self.seed}"


def clip_frames(clip: Clip) -> np.ndarray:
    """The clip's frames before encoding: a seeded picture panning and changing colour,
    [T, H, W, 3] uint8."""
    base = np.asarray(synthetic_image(clip.width * 2, clip.height, seed=clip.seed))
    frames = []
    for t in range(clip.num_frames):
        shift = (t * clip.width) // max(clip.num_frames, 1)
        frame = base[:, shift : shift + clip.width].astype(np.int16)
        frame[..., t % 3] += 40  # a colour change per frame, so frames differ beyond the pan
        frames.append(np.clip(frame, 0, 255).astype(np.uint8))
    return np.stack(frames)


def encode_clip(clip: Clip) -> bytes:
    """The clip in its container (even sides for H.264's 4:2:0)."""
    container_format, codec = _CODECS[clip.container]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format, options=_CONTAINER_OPTIONS) as container:
        stream = container.add_stream(codec, rate=clip.fps)
        stream.width, stream.height = clip.width, clip.height
        if clip.container == "gif":
            stream.pix_fmt = "rgb8"
        else:
            stream.pix_fmt = "yuv420p"
            stream.codec_context.thread_count = 1
            stream.options = (
                {"crf": "18", "preset": "fast", **_X264_PARAMS}
                if codec == "libx264"
                else {"crf": "10", "b": "2M"}
            )
        for frame_array in clip_frames(clip):
            frame = av.VideoFrame.from_ndarray(frame_array, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def frames_as_images(frames: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(f) for f in frames]


def encode_blank(width: int, height: int, num_frames: int, container: str = "mp4") -> bytes:
    """Black frames, encoded as fast as possible: for clips whose size, not content, matters
    (thousands of frames, frames of many megapixels, none at all)."""
    container_format, codec = _CODECS[container]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format, options=_CONTAINER_OPTIONS) as output:
        stream = output.add_stream(codec, rate=30)
        stream.width, stream.height = width, height
        stream.pix_fmt = "rgb8" if container == "gif" else "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", **_X264_PARAMS}
        output.start_encoding()  # writes the header even when no frame follows
        frame = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24")
        for _ in range(num_frames):
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()
