"""Large, long-lived CPU tensors on transparent huge pages (2 MiB), asked for with madvise.

A decode step streams every packed weight and every cached key and value from memory. On 4 KiB
pages that is a TLB miss every 4 KiB and a hardware prefetcher that stops at each page edge;
measured at the mid model's KV cache shapes (12 layers × 8 requests × 512 tokens, caches cold),
the paged attention kernel took 17-37 % less time on huge pages (BENCHMARKS.md, "Decode a
fourth time"). Linux gives huge pages to anonymous memory that asks for them when
`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise` (the usual default);
with `never` these tensors are plain ones. Pages are only made huge when first touched after the
advice, so the advice comes before anything is written (torch's own `THP_MEM_ALLOC_ENABLE`
does the same for every allocation, but it is read once, before torch's first allocation, which
in the offline `LLM` is long past).
"""

from __future__ import annotations

import logging
import mmap

import torch

logger = logging.getLogger("mmserve.ops")

HUGE_PAGE_BYTES = 2 << 20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor like `torch.empty(shape, dtype=dtype)`, whose data
    starts on a 2 MiB boundary of a fresh anonymous mapping (up to 2 MiB longer than the data,
    kept alive by the tensor) advised huge. Below one huge page, or where the advice is refused,
    a plain `torch.empty`."""
    num_bytes = torch.Size(shape).numel() * dtype.itemsize
    if num_bytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # private: shared anonymous memory is shmem, whose huge pages are a separate setting (off)
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    offset = -buffer.data_ptr() % HUGE_PAGE_BYTES  # a multiple of 4 KiB: mmap is page-aligned
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, num_bytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError as error:  # e.g. a kernel built without transparent huge pages
        logger.debug("madvise(MADV_HUGEPAGE) refused: %s", error)
        return torch.empty(shape, dtype=dtype)
    return buffer[offset : offset + num_bytes].view(dtype).view(shape)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`empty_on_huge_pages` filled with zeros (the first touch, so the pages are born huge)."""
    return empty_on_huge_pages(shape, dtype).zero_()
