"""Rescale and normalise uint8 levels exactly as transformers does, as fast as numpy allows."""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np


class NormaliseSettings(Protocol):
    """What normalising reads of a transform's (hashable) settings."""

    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float


_CHANNEL_OFFSETS = np.array([0, 256, 512], dtype=np.uint16).reshape(1, 3, 1)


class Normaliser:
    """`(float32(level · rescale_factor) − mean_c) / std_c`, bit-identical to transformers
    (rescale in float64 then cast, subtract and divide in float32).

    The result depends only on (level, channel): 768 cases, all checked here. The fast path,
    a vectorised float32 division by 1/rescale_factor, is used when it matches in every case
    (it does for the usual 1/255); otherwise a gather from the exact 768-entry table.
    """

    def __init__(self, settings: NormaliseSettings) -> None:
        self._mean = np.asarray(settings.image_mean, dtype=np.float32).reshape(1, 3, 1)
        self._std = np.asarray(settings.image_std, dtype=np.float32).reshape(1, 3, 1)
        self._divisor = np.float32(1 / settings.rescale_factor)
        rescaled = (np.arange(256, dtype=np.float64) * settings.rescale_factor).astype(np.float32)
        self.table = (rescaled[None, None, :] - self._mean) / self._std  # [1, 3, 256] float32
        every_level = np.broadcast_to(np.arange(256, dtype=np.uint8), (1, 3, 256))
        self.exact_arithmetic = bool(np.array_equal(self._arithmetic(every_level), self.table))

    def __call__(self, levels: np.ndarray) -> np.ndarray:
        """levels [N, 3, K] uint8 -> normalised [N, 3, K] float32."""
        if self.exact_arithmetic:
            return self._arithmetic(levels)
        # mode="wrap" skips numpy's bounds-check buffering; indices are < 768 by construction.
        return np.take(self.table.ravel(), levels + _CHANNEL_OFFSETS, mode="wrap")

    def _arithmetic(self, levels: np.ndarray) -> np.ndarray:
        values = levels.astype(np.float32)
        values /= self._divisor
        values -= self._mean
        values /= self._std
        return values


@functools.lru_cache(maxsize=8)
def normaliser(settings: NormaliseSettings) -> Normaliser:
    return Normaliser(settings)
