"""Image and video preprocessing for Qwen2-VL / Qwen2.5-VL / Qwen3-VL, outside the engine:
decode, resize, normalise and patchify into shared memory, in worker processes, with a
content-hash cache.

Imports nothing from `mmserve`. Output equals transformers' `Qwen2VLImageProcessorPil` for
images and its Qwen video processors for videos.
"""

from __future__ import annotations

from preprocess.errors import (
    CorruptImage,
    CorruptVideo,
    EmptyImage,
    EmptyVideo,
    ExtremeAspectRatio,
    ImageError,
    ImageTooComplex,
    ImageTooLarge,
    PreprocessError,
    PreprocessFailed,
    PreprocessPoolClosed,
    PreprocessWorkerDied,
    UnsupportedImageFormat,
    UnsupportedVideoFormat,
    VideoError,
    VideoTooLarge,
)
from preprocess.hashing import mm_hash
from preprocess.pool import PoolStats, PreprocessPool
from preprocess.probe import ImageHeader, probe
from preprocess.processed import ProcessedImage
from preprocess.settings import ProcessorSettings
from preprocess.shm import ShmHandle, attach
from preprocess.video import FrameSampling, VideoInfo, VideoSource
from preprocess.video_settings import VideoSettings

__all__ = [
    "CorruptImage",
    "CorruptVideo",
    "EmptyImage",
    "EmptyVideo",
    "ExtremeAspectRatio",
    "FrameSampling",
    "ImageError",
    "ImageHeader",
    "ImageTooComplex",
    "ImageTooLarge",
    "PoolStats",
    "PreprocessError",
    "PreprocessFailed",
    "PreprocessPool",
    "PreprocessPoolClosed",
    "PreprocessWorkerDied",
    "ProcessedImage",
    "ProcessorSettings",
    "ShmHandle",
    "UnsupportedImageFormat",
    "UnsupportedVideoFormat",
    "VideoError",
    "VideoInfo",
    "VideoSettings",
    "VideoSource",
    "VideoTooLarge",
    "attach",
    "mm_hash",
    "probe",
]
