"""An auxiliary training loss: each image token says what lies under it and where it is.

Trained on answers alone, the tiny model learnt colours slowly and positions not at all in
1,000 steps: Qwen2-VL's vision tower has only relative (rotary) positions, so "top left" of a
picture of any size has to be worked out from the picture's edges, and nothing pushed the tower
to do that. Here a linear head on the merger output (the embeddings the language model
receives) classifies every image token by 3×3 cell of the picture, and by the colour, shape and
word of the object covering it. The head exists only during training and is not saved.
"""

from __future__ import annotations

import numpy as np
import torch

from mmserve.testing.demo.pictures import CELLS, COLOURS, SHAPES, WORDS, Box, Scene

# Label columns and their class counts; class 0 of colour/shape/word is "nothing there".
NUM_CLASSES = {"cell": 9, "colour": 1 + len(COLOURS), "shape": 1 + len(SHAPES), "word": 1 + len(WORDS)}
MIN_OVERLAP = 0.2  # fraction of a token's area an object must cover to label it
_COLOUR_IDS = {c: i + 1 for i, c in enumerate(COLOURS)}
_SHAPE_IDS = {s: i + 1 for i, s in enumerate(SHAPES)}
_WORD_IDS = {w: i + 1 for i, w in enumerate(WORDS)}


def _overlap(box: Box, x0: np.ndarray, y0: np.ndarray, x1: np.ndarray, y1: np.ndarray) -> np.ndarray:
    w = np.clip(np.minimum(x1, box[2]) - np.maximum(x0, box[0]), 0, None)
    h = np.clip(np.minimum(y1, box[3]) - np.maximum(y0, box[1]), 0, None)
    return w * h / ((x1 - x0) * (y1 - y0))


def token_labels(
    scene: Scene, boxes: list[Box], word_box: Box | None, grid_thw: tuple[int, int, int], merge_size: int
) -> np.ndarray:
    """[num_tokens, 4] int64 (cell, colour, shape, word) per merged image token, row-major.

    The processor resizes the whole picture, so token (r, c) of a rows×cols grid covers the
    same fraction of the original picture: x in [c/cols, (c+1)/cols) of the width, and so on.
    """
    rows, cols = grid_thw[1] // merge_size, grid_thw[2] // merge_size
    r, c = np.mgrid[0:rows, 0:cols]
    x0, x1 = c / cols * scene.width, (c + 1) / cols * scene.width
    y0, y1 = r / rows * scene.height, (r + 1) / rows * scene.height
    centre_col = np.minimum((3 * (c + 0.5) / cols).astype(int), 2)
    centre_row = np.minimum((3 * (r + 0.5) / rows).astype(int), 2)
    labels = np.zeros((rows, cols, 4), dtype=np.int64)
    labels[..., 0] = 3 * centre_row + centre_col
    best = np.full((rows, cols), MIN_OVERLAP)
    for item, box in zip(scene.items, boxes):
        cover = _overlap(box, x0, y0, x1, y1)
        # A shape smaller than a token still labels the token holding its centre.
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        holds_centre = (x0 <= cx) & (cx < x1) & (y0 <= cy) & (cy < y1)
        cover = np.where(holds_centre, np.maximum(cover, 1.0), cover)
        mine = cover >= best
        best = np.where(mine, cover, best)
        col, row = CELLS[item.position]
        labels[mine, 0] = 3 * row + col
        labels[mine, 1] = _COLOUR_IDS[item.colour]
        labels[mine, 2] = _SHAPE_IDS[item.shape]
    if word_box is not None:
        labels[_overlap(word_box, x0, y0, x1, y1) >= MIN_OVERLAP, 3] = _WORD_IDS[scene.word]
    return labels.reshape(rows * cols, 4)


class GroundingHead(torch.nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, sum(NUM_CLASSES.values()))

    def loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the four labels; features [N, hidden], labels [N, 4]."""
        logits = self.proj(features).float()  # [N, sum of classes]
        parts = torch.split(logits, list(NUM_CLASSES.values()), dim=-1)
        losses = [torch.nn.functional.cross_entropy(part, labels[:, i]) for i, part in enumerate(parts)]
        return torch.stack(losses).mean()
