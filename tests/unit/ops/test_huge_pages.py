"""Tensors for the weights and KV cache on transparent huge pages (mmserve.ops.huge_pages)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mmserve.ops.huge_pages import HUGE_PAGE_BYTES, empty_on_huge_pages, zeros_on_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The bracketed choice of the kernel's THP setting ('always', 'madvise', 'never'), or ''."""
    if not THP_SETTING.exists():
        return ""
    match = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    return match.group(1) if match else ""


def huge_kib_of(tensor: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mappings that hold `tensor`'s bytes, from /proc/self/smaps."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            low, high = int(head.group(1), 16), int(head.group(2), 16)
            inside = low < end and start < high
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize(
    "shape, dtype",
    [((2, 37, 16, 4, 64), torch.float32), ((97, 768, 16), torch.bfloat16), ((3, 5), torch.float32)],
)
def test_tensors_have_the_asked_shape_dtype_and_contents(shape, dtype):
    zeros = zeros_on_huge_pages(shape, dtype)
    assert zeros.shape == shape and zeros.dtype == dtype and zeros.is_contiguous()
    assert not zeros.any()
    empty = empty_on_huge_pages(shape, dtype)
    empty.copy_(torch.arange(empty.numel()).view(shape).to(dtype))  # every byte writable, no overlap
    assert torch.equal(empty.flatten(), torch.arange(empty.numel()).to(dtype))


def test_large_tensors_start_on_a_huge_page_and_outlive_their_views():
    tensor = empty_on_huge_pages((3 * HUGE_PAGE_BYTES // 4 + 7,), torch.float32)
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    view = tensor[5:9]
    del tensor
    view.fill_(2.0)  # the mapping is held by the view's storage
    assert view.sum().item() == 8.0


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="the kernel gives no huge pages here")
def test_the_pages_are_huge_once_touched():
    """On a kernel that grants huge pages on request, the whole 2 MiB pages of the data are huge
    (a shared mapping, for one, would get none: its huge pages are a separate setting)."""
    tensor = zeros_on_huge_pages((4 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 8 MiB
    assert huge_kib_of(tensor) >= 4 * HUGE_PAGE_BYTES // 1024
