"""What a request's span of tokens this step needs from the encoder cache.

A span that reaches an image not in the encoder cache encodes the whole image this step if the
step's encoder budget and the cache allow it, else the span stops just before the image (it is
tried again next step). Images the span reads from the cache are kept while planning: their room
cannot be counted as evictable for the images the same span encodes. An image is either cached
or encoded from the pixels its request holds: there is no third case.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.core.encoder_cache_manager import EncoderCacheManager
from mmserve.core.request import Request


@dataclass
class SpanPlan:
    """A span and its images; nothing is reserved until the scheduler keeps the span."""

    num_new_tokens: int  # the span, shortened to stop before an image that cannot be encoded
    to_encode: list[int]  # feature indices to encode this step
    to_reference: list[int]  # feature indices already cached
    encoder_budget: int  # what remains of the step's encoder budget afterwards


def plan_span(
    cache: EncoderCacheManager, request: Request, num_computed: int, num_new: int, encoder_budget: int
) -> SpanPlan:
    """Plan the span [num_computed, num_computed + num_new) of `request`."""
    to_encode, to_reference = [], []
    encoded: set[str] = set()
    kept: set[str] = set()
    encode_size = 0
    for index, f in enumerate(request.mm_features):
        if f.offset >= num_computed + num_new:
            break
        if f.offset + f.length <= num_computed or f.mm_hash in encoded or f.mm_hash in kept:
            continue  # already computed past this image, or already in the plan
        is_cached = cache.is_cached(f.mm_hash)
        if is_cached:
            fits = cache.can_allocate(encode_size, keep=kept | {f.mm_hash})
        else:
            fits = f.length <= encoder_budget and cache.can_allocate(encode_size + f.length, keep=kept)
        if not fits:
            num_new = max(f.offset - num_computed, 0)  # stop just before this image
            break
        if is_cached:
            kept.add(f.mm_hash)
            to_reference.append(index)
        else:
            encoder_budget -= f.length
            encode_size += f.length
            encoded.add(f.mm_hash)
            to_encode.append(index)
    return SpanPlan(num_new, to_encode, to_reference, encoder_budget)
