"""The vision tower data-parallel across the ranks (vLLM's `--mm-encoder-tp-mode data`).

Every rank holds the whole (small) tower. The items of a step are dealt to the ranks so each
encodes about the same number of patches (largest first, to the least loaded rank); each rank
encodes its items in one call, the merged rows are padded to the longest share and all-gathered,
and every rank puts them back in the step's item order. The deal depends only on the grids,
which every rank has, so no sizes need to be exchanged first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmserve.distributed.parallel_state import TensorParallelGroup

Grid = tuple[int, int, int]


def deal_items(num_patches: Sequence[int], world_size: int) -> list[list[int]]:
    """Item indices per rank, each rank's in ascending order, balancing patch counts."""
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for item in sorted(range(len(num_patches)), key=lambda i: (-num_patches[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(item)
        loads[rank] += num_patches[item]
    return [sorted(share) for share in shares]


def encode_data_parallel(
    tower: nn.Module,
    pixel_values: torch.Tensor,  # [num_patches, C·T·P·P], the items one after another
    grid_thw: Sequence[Grid],
    merge_unit: int,  # patches per merged token
    group: TensorParallelGroup,
) -> torch.Tensor:
    """The tower's output for every item ([num_patches / merge_unit, tower.output_width]), as one
    call over all items would give it, with each rank encoding only its share."""
    patches = [t * h * w for t, h, w in grid_thw]
    starts = [sum(patches[:i]) for i in range(len(patches))]
    shares = deal_items(patches, group.world_size)
    rows = [[patches[i] // merge_unit for i in share] for share in shares]
    mine = shares[group.rank]
    width, dtype = tower.output_width, tower.patch_embed.proj.weight_dtype
    longest = max(sum(r) for r in rows)
    padded = torch.zeros(longest, width, dtype=dtype, device=pixel_values.device)  # [longest, width]
    if mine:
        local_pixels = torch.cat([pixel_values[starts[i] : starts[i] + patches[i]] for i in mine])
        local = tower(local_pixels, [grid_thw[i] for i in mine])
        padded[: local.shape[0]] = local
    gathered = group.all_gather(padded[None], dim=0)  # [world, longest, width]
    by_item: dict[int, torch.Tensor] = {}
    for rank, share in enumerate(shares):
        pieces = gathered[rank, : sum(rows[rank])].split(rows[rank])
        by_item.update(zip(share, pieces))
    return torch.cat([by_item[i] for i in range(len(patches))])
