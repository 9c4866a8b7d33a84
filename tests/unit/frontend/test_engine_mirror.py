"""The frontend's mirror of the engine's encoder cache: an image goes by hash only when the
engine (as last heard) holds it and its shape is known; changes apply in order."""

from __future__ import annotations

from mmserve.frontend.engine_mirror import EngineMirror, PixelSources


def test_an_image_goes_by_hash_only_when_held_and_its_shape_is_known():
    mirror = EngineMirror()
    assert mirror.by_hash("a") is None
    mirror.apply({"a": True})
    assert mirror.by_hash("a") is None  # held, but its shape was never learned here
    mirror.learn("a", (1, 4, 6), 6)
    image = mirror.by_hash("a")
    assert (image.mm_hash, image.grid_thw, image.num_tokens, image.pixel_values) == ("a", (1, 4, 6), 6, None)
    mirror.apply({"a": False})
    assert mirror.by_hash("a") is None


def test_changes_apply_in_their_order_and_reset_forgets_the_engine():
    mirror = EngineMirror()
    mirror.learn("a", (1, 2, 2), 1)
    mirror.learn("b", (1, 2, 2), 1)
    mirror.apply({"b": False, "a": True})
    mirror.apply({"a": False, "b": True})
    assert mirror.by_hash("a") is None and mirror.by_hash("b") is not None
    mirror.reset()
    assert mirror.num_in_engine() == 0 and mirror.by_hash("b") is None


def test_shapes_are_bounded_least_recently_learned_first():
    mirror = EngineMirror(max_shapes=2)
    for name in "abc":
        mirror.learn(name, (1, 2, 2), 1)
    mirror.apply({"a": True, "b": True, "c": True})
    assert [mirror.by_hash(n) is not None for n in "abc"] == [False, True, True]


def test_pixel_sources_are_kept_per_request_until_forgotten():
    sources = PixelSources()
    sources.add("r1", {"a": b"bytes of a"})
    sources.add("r2", {"a": b"bytes of a"})
    sources.add("r3", {})
    assert sources.get("r1", "a") == b"bytes of a" and sources.get("r1", "b") is None
    sources.forget(["r1", "r3"])
    assert sources.get("r1", "a") is None and len(sources) == 1
