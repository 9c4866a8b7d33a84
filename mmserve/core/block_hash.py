"""Prefix-cache keys: a chain of 128-bit hashes, one per full block of tokens.

hash(block i) = xxh3_128(hash(block i-1) ‖ the block's token ids ‖ extra keys), where the extra
keys list, for every image overlapping the block, its content hash and its first token's offset
relative to the block start (negative when the image began in an earlier block). Equal hashes
therefore mean equal tokens *and* equal images at equal places all the way from the start.
Only full blocks are hashed, each once, as tokens arrive.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from mmserve.protocol import MultiModalFeature

BlockHash = bytes  # 16-byte xxh3_128 digest

_HASH_SEED = 0x6D6D7365  # "mmse": fixed, so hashes are stable across processes and restarts
ROOT_PARENT: BlockHash = b"\x00" * 16  # the parent of the first block


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b"") -> BlockHash:
    h = xxhash.xxh3_128(seed=_HASH_SEED)
    h.update(parent)
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    if extra_keys:
        h.update(b"\xff")  # separates token bytes from extra keys
        h.update(extra_keys)
    return h.digest()


def image_extra_keys(features: Sequence[MultiModalFeature], block_start: int, block_end: int) -> bytes:
    """Encoding of every image overlapping [block_start, block_end): hash + relative offset."""
    keys = bytearray()
    for f in features:
        if f.offset < block_end and f.offset + f.length > block_start:
            keys += f.mm_hash.encode()
            keys += int(f.offset - block_start).to_bytes(8, "little", signed=True)
    return bytes(keys)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    features: Sequence[MultiModalFeature],
    block_size: int,
) -> None:
    """Append the hashes of the blocks that became full since `block_hashes` was last extended."""
    for i in range(len(block_hashes), len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        parent = block_hashes[-1] if block_hashes else ROOT_PARENT
        extra = image_extra_keys(features, start, end) if features else b""
        block_hashes.append(hash_block(parent, token_ids[start:end], extra))
