"""Image preprocessing for Qwen2-VL / Qwen2.5-VL, outside the engine: decode, resize,
normalise and patchify into shared memory, in worker processes, with a content-hash cache.

Imports nothing from `mmserve`. Output equals transformers' `Qwen2VLImageProcessorPil`.
"""

from __future__ import annotations

from preprocess.errors import (
    CorruptImage,
    EmptyImage,
    ExtremeAspectRatio,
    ImageError,
    ImageTooComplex,
    ImageTooLarge,
    PreprocessError,
    PreprocessFailed,
    PreprocessPoolClosed,
    PreprocessWorkerDied,
    UnsupportedImageFormat,
)
from preprocess.hashing import mm_hash
from preprocess.pool import PoolStats, PreprocessPool
from preprocess.probe import ImageHeader, probe
from preprocess.processed import ProcessedImage
from preprocess.settings import ProcessorSettings
from preprocess.shm import ShmHandle, attach

__all__ = [
    "CorruptImage",
    "EmptyImage",
    "ExtremeAspectRatio",
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
    "attach",
    "mm_hash",
    "probe",
]
