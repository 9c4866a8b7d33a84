"""Helpers shared by the tests of mmserve.core: prompts with images, and the block pool's
consistency check."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.core.block_pool import BlockPool
from mmserve.protocol import MultiModalFeature

IMAGE_TOKEN = 100  # the placeholder token an image's run is made of


@dataclass(frozen=True)
class Image:
    mm_hash: str
    length: int  # placeholder tokens = embeddings


def build_prompt(*parts: list[int] | Image) -> tuple[list[int], list[MultiModalFeature]]:
    """Text runs and images in order → token ids (placeholders expanded) and features."""
    tokens: list[int] = []
    features: list[MultiModalFeature] = []
    for part in parts:
        if isinstance(part, Image):
            features.append(MultiModalFeature(part.mm_hash, len(tokens), part.length, (1, 1, part.length)))
            tokens += [IMAGE_TOKEN] * part.length
        else:
            tokens += list(part)
    return tokens, features


def assert_pool_consistent(pool: BlockPool) -> None:
    """The free list walks the same both ways, holds exactly the ref-0 blocks once each, and the
    hash map and the blocks' own hashes agree."""
    queue = pool.free_queue
    forward = list(queue)
    assert list(reversed(queue))[::-1] == forward
    assert len(forward) == queue.num_free == pool.num_free_blocks
    assert len({b.block_id for b in forward}) == len(forward)
    in_free = {b.block_id for b in forward}
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b.ref_cnt == 0) == (b.block_id in in_free), b
        if b.ref_cnt > 0:
            assert b.prev_free is None and b.next_free is None
        if b.block_hash is not None:
            assert pool.cached[b.block_hash] is b
    for block_hash, b in pool.cached.items():
        assert b.block_hash == block_hash
