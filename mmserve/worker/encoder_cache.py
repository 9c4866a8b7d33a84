"""The encoder cache's storage: image hash → its embeddings, on the model's device.

Which hashes may stay is decided by the scheduler's EncoderCacheManager (bookkeeping only);
this store holds the tensors and drops what the scheduler says it freed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EncoderCache:
    def __init__(self) -> None:
        self._embeddings: dict[str, torch.Tensor] = {}

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._embeddings

    def __len__(self) -> int:
        return len(self._embeddings)

    def put(self, mm_hash: str, embeddings: torch.Tensor) -> None:
        """embeddings: [num_tokens, hidden]"""
        self._embeddings[mm_hash] = embeddings

    def get(self, mm_hash: str) -> torch.Tensor:
        try:
            return self._embeddings[mm_hash]
        except KeyError:
            raise RuntimeError(
                f"embeddings of image {mm_hash} are needed but not in the encoder cache"
            ) from None

    def free(self, mm_hashes: Iterable[str]) -> None:
        for mm_hash in mm_hashes:
            self._embeddings.pop(mm_hash, None)
