"""Image and video preprocessing outside the engine: decode, then the transform a model family
chose (its settings, transform.py), into shared memory, in worker processes, with a
content-hash cache keyed by the bytes and the settings.

Imports nothing from `mmserve`. Each transform module reproduces one family of transformers'
processors exactly, in a module named for it.
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
from preprocess.shm import ShmHandle, attach
from preprocess.transform import GridTHW, ImageTransform, VideoTransform
from preprocess.video import FrameSampling, VideoInfo, VideoSource

__all__ = [
    "CorruptImage",
    "CorruptVideo",
    "EmptyImage",
    "EmptyVideo",
    "ExtremeAspectRatio",
    "FrameSampling",
    "GridTHW",
    "ImageError",
    "ImageHeader",
    "ImageTooComplex",
    "ImageTooLarge",
    "ImageTransform",
    "PoolStats",
    "PreprocessError",
    "PreprocessFailed",
    "PreprocessPool",
    "PreprocessPoolClosed",
    "PreprocessWorkerDied",
    "ProcessedImage",
    "ShmHandle",
    "UnsupportedImageFormat",
    "UnsupportedVideoFormat",
    "VideoError",
    "VideoInfo",
    "VideoSource",
    "VideoTooLarge",
    "VideoTransform",
    "attach",
    "mm_hash",
    "probe",
]
