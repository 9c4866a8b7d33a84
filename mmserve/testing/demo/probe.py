"""What the demo model's vision tower sees: the grounding head's accuracy per label.

    python -m mmserve.testing.demo.probe ~/.cache/mmserve/demo-train/state.pt --vision-depth 4

Reads a training state (the grounding head is not in the model folder), runs the vision tower on
held-out pictures and reports, per label (cell, colour, shape, word), how often the head's
argmax is right: over all image tokens, and over the tokens an object covers, which are the ones
that matter (most tokens are background, which is easy). A label far below the others names
the skill that limits the answers; this is how the shape and word recognition of the first
demo model were found to be the weak part (78 % and 18 % of object tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from mmserve.testing.demo import folder, train
from mmserve.testing.demo.dialogues import dialogues
from mmserve.testing.demo.grounding import NUM_CLASSES, GroundingHead

BATCH = 32


@torch.no_grad()
def label_accuracy(state_path: Path, work_dir: Path, vision_depth: int, num: int, seed: int) -> dict:
    """{label: (all-token accuracy, object-token accuracy, object tokens)}."""
    preset = dataclasses.replace(folder.PRESET, vision_depth=vision_depth)
    model_dir = folder.write_files(work_dir, preset)
    encoder = train.Encoder(model_dir)
    model = train.new_model(model_dir, seed)
    head = GroundingHead(preset.hidden_size)
    state = torch.load(state_path, weights_only=True)
    model.load_state_dict(state["model"])
    head.load_state_dict(state["head"])
    model.eval()
    examples = [encoder.encode(d) for d in dialogues("probe", seed, num) if d.scene is not None]
    right = {name: [0, 0, 0, 0] for name in NUM_CLASSES}  # all right, all, object right, objects
    for start in range(0, len(examples), BATCH):
        batch = train.collate(examples[start : start + BATCH], encoder)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            vision = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
        features = vision.pooler_output  # the merger's output: what the language model receives
        logits = head.proj(features.float())
        labels = batch["token_labels"]
        parts = torch.split(logits, list(NUM_CLASSES.values()), -1)
        for i, (name, part) in enumerate(zip(NUM_CLASSES, parts)):
            hit = part.argmax(-1) == labels[:, i]
            on_object = labels[:, 2 if name == "cell" else i] > 0  # a cell matters where a shape is
            right[name][0] += int(hit.sum())
            right[name][1] += len(hit)
            right[name][2] += int(hit[on_object].sum())
            right[name][3] += int(on_object.sum())
    return {name: (r[0] / r[1], r[2] / max(1, r[3]), r[3]) for name, r in right.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("state", type=Path, help="a training run's state.pt")
    parser.add_argument("--vision-depth", type=int, default=folder.PRESET.vision_depth)
    parser.add_argument("--num", type=int, default=300, help="held-out dialogues (with a picture or not)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/mmserve-demo-probe"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    accuracy = label_accuracy(args.state, args.work_dir, args.vision_depth, args.num, args.seed)
    print(f"{'label':<8}{'all tokens':>12}{'object tokens':>15}{'n':>7}")
    for name, (every, objects, count) in accuracy.items():
        print(f"{name:<8}{100 * every:>11.1f}%{100 * objects:>14.1f}%{count:>7}")


if __name__ == "__main__":
    main()
