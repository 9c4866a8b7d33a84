"""Typed errors of the preprocess package.

Two families that callers treat differently:

* `ImageError` (a `ValueError`): the client sent an image we will not process. The message is
  safe to show to the client (it names the problem, never a file path or a traceback).
* `PreprocessError` (a `RuntimeError`): the pool failed, not the image; the server answers 5xx.

Policy on small images: any image of at least 1×1 pixels is accepted and upscaled to
`min_pixels`, exactly as transformers' `smart_resize` does; only zero-sized images are refused.
"""

from __future__ import annotations


class ImageError(ValueError):
    """Base class for an image that cannot be processed; the message is client-safe."""


class UnsupportedImageFormat(ImageError):
    """The bytes are not an image in a supported format, or the mode cannot become RGB."""


class CorruptImage(ImageError):
    """The format was recognised but the pixel data is truncated or malformed."""


class EmptyImage(ImageError):
    """The image has zero width or height."""


class ImageTooLarge(ImageError):
    """The header announces more pixels than allowed (decompression-bomb guard)."""


class ImageTooComplex(ImageError):
    """The container holds more chunks, markers, blocks or tags than a real image needs
    (each costs parsing time; a file of millions of empty ones is a denial of service)."""


class ExtremeAspectRatio(ImageError):
    """The longer side is more than 200 times the shorter one (the model's limit)."""


class PreprocessError(RuntimeError):
    """Base class for failures of the pool itself rather than of the image."""


class PreprocessWorkerDied(PreprocessError):
    """The worker process holding the request exited (crash, OOM kill, signal)."""


class PreprocessPoolClosed(PreprocessError):
    """The pool was closed before the request finished."""


class PreprocessFailed(PreprocessError):
    """An unexpected exception inside a worker; the message carries its type and text."""


class VideoError(ImageError):
    """A video that cannot be processed; the message is client-safe. An `ImageError`, so every
    caller that answers a bad image with a 4xx answers a bad video the same way."""


class UnsupportedVideoFormat(VideoError):
    """The bytes are not a video in a supported container, or have no video stream."""


class CorruptVideo(VideoError):
    """The container was recognised but its frames are truncated or cannot be decoded."""


class EmptyVideo(VideoError):
    """The video has no frames (or too few for the model)."""


class VideoTooLarge(VideoError):
    """The header announces more frames, or frames × pixels, than allowed (video bombs)."""
