"""Host arrays onto the device without stalling the host."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`. On CUDA through pinned memory and a non-blocking copy: a copy from
    pageable memory makes the host wait for the stream, a device sync in all but name, and
    torch's caching host allocator holds the pinned block until the copy has run. Elsewhere the
    array itself, shared."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
