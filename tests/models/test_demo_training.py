"""Growing the demo model's vision tower mid-training keeps what the model computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmserve.testing.demo import folder, train
from mmserve.testing.demo.dialogues import dialogues


def model_with_vision_depth(tmp_path, depth: int, seed: int):
    preset = dataclasses.replace(folder.PRESET, vision_depth=depth)
    model_dir = folder.write_files(tmp_path / f"depth-{depth}", preset)
    return train.new_model(model_dir, seed), train.Encoder(model_dir)


def test_a_grown_vision_tower_starts_as_the_model_it_grew_from(tmp_path):
    small, encoder = model_with_vision_depth(tmp_path, 1, seed=0)
    grown, _ = model_with_vision_depth(tmp_path, 3, seed=1)
    examples = [encoder.encode(d) for d in dialogues("heldout", 0, 4) if d.scene is not None]
    batch = train.collate(examples, encoder)

    assert train.load_grown(grown, small.state_dict())

    with torch.no_grad():
        expected, targets, _ = train.answer_logits(small, batch)
        logits, grown_targets, _ = train.answer_logits(grown, batch)
    assert torch.equal(targets, grown_targets)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # The added blocks are there to be trained: their branches' inputs are not zero.
    assert grown.model.visual.blocks[2].mlp.fc1.weight.abs().sum() > 0


def test_weights_of_the_same_shape_load_as_they_are(tmp_path):
    model, _ = model_with_vision_depth(tmp_path, 1, seed=0)
    twin, _ = model_with_vision_depth(tmp_path, 1, seed=1)
    assert not train.load_grown(twin, model.state_dict())
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name


def test_weights_from_a_different_model_are_refused(tmp_path):
    model, _ = model_with_vision_depth(tmp_path, 1, seed=0)
    weights = model.state_dict()
    del weights["model.language_model.norm.weight"]
    with pytest.raises(ValueError, match="do not fit"):
        train.load_grown(model, weights)


def test_the_probe_scores_object_tokens_apart_from_background(tmp_path):
    """A head that always says "nothing here" (and the centre cell) is right on background
    tokens only: the probe must show it as 0 % on the tokens that objects cover."""
    from mmserve.testing.demo import probe
    from mmserve.testing.demo.grounding import NUM_CLASSES, GroundingHead

    model, _ = model_with_vision_depth(tmp_path, 1, seed=0)
    head = GroundingHead(folder.PRESET.hidden_size)
    with torch.no_grad():
        head.proj.weight.zero_()
        head.proj.bias.zero_()
        offsets = torch.tensor([0, *NUM_CLASSES.values()]).cumsum(0)
        head.proj.bias[offsets[1:-1]] = 1.0  # class 0 of colour, shape and word
        head.proj.bias[4] = 1.0  # cell 4, the centre
    torch.save({"model": model.state_dict(), "head": head.state_dict()}, tmp_path / "state.pt")

    accuracy = probe.label_accuracy(tmp_path / "state.pt", tmp_path / "probe", 1, num=12, seed=0)

    for name in ("colour", "shape", "word"):
        every, objects, count = accuracy[name]
        assert count > 0 and objects == 0.0 and 0.5 < every < 1.0, (name, accuracy[name])
    every, objects, _ = accuracy["cell"]
    assert 0.0 < every < 0.5 and 0.0 <= objects < 0.5  # one cell in nine
