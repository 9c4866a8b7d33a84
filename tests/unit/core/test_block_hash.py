"""Prefix-cache keys: equal block hashes mean equal tokens and equal images at equal places, from
the start of the prompt through the end of the block."""

from __future__ import annotations

from core_helpers import IMAGE_TOKEN, Image, build_prompt
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.core.block_hash import ROOT_PARENT, extend_block_hashes, hash_block, image_extra_keys
from mmserve.core.request import Request
from mmserve.protocol import MultiModalFeature
from mmserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def block_hashes(*parts: list[int] | Image, block_size: int = BLOCK_SIZE) -> list[bytes]:
    tokens, features = build_prompt(*parts)
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, features, block_size)
    return hashes


def num_shared(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def text(n: int, start: int = 2) -> list[int]:
    return list(range(start, start + n))


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(text(11))) == 2
    assert len(block_hashes(text(12))) == 3
    assert block_hashes(text(3)) == []


def test_same_text_and_same_image_share_every_block():
    parts = (text(6), Image("img-a", 8), text(6))
    assert block_hashes(*parts) == block_hashes(*parts)


def test_same_text_different_image_shares_no_block_from_the_first_one_overlapping_the_image():
    a = block_hashes(text(6), Image("img-a", 8), text(6))
    b = block_hashes(text(6), Image("img-b", 8), text(6))
    assert len(a) == len(b) == 5
    assert a[0] == b[0]  # tokens 0..4: before the image
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # block 1 holds the image's first tokens


def test_image_starting_on_a_block_boundary_keeps_every_block_before_it():
    a = block_hashes(text(8), Image("img-a", 8), text(4))
    b = block_hashes(text(8), Image("img-b", 8), text(4))
    assert num_shared(a, b) == 2


def test_a_block_entirely_inside_an_image_is_keyed_by_that_image():
    _, features = build_prompt(text(2), Image("img-a", 12))
    inside = image_extra_keys(features, 4, 8)  # the image began in the block before
    assert inside
    assert inside != image_extra_keys(features, 8, 12)  # its offset relative to the block differs
    assert image_extra_keys(features, 0, 2) == b""


def test_same_image_at_another_position_gives_no_false_hit():
    # Identical token ids (the text happens to be the placeholder id): only the offset differs.
    a = block_hashes([IMAGE_TOKEN] * 2, Image("img-a", 8), [IMAGE_TOKEN] * 2)
    b = block_hashes(Image("img-a", 8), [IMAGE_TOKEN] * 4)
    assert build_prompt([IMAGE_TOKEN] * 2, Image("img-a", 8), [IMAGE_TOKEN] * 2)[0] == [IMAGE_TOKEN] * 12
    assert num_shared(a, b) == 0
    tokens = [IMAGE_TOKEN] * BLOCK_SIZE
    at_0 = image_extra_keys([MultiModalFeature("img-a", 0, 8, (1, 1, 8))], 0, 4)
    at_1 = image_extra_keys([MultiModalFeature("img-a", 1, 8, (1, 1, 8))], 0, 4)
    assert hash_block(ROOT_PARENT, tokens, at_0) != hash_block(ROOT_PARENT, tokens, at_1)


def test_two_different_images_never_collide():
    seen = {}
    for i in range(2000):
        first = block_hashes(text(2), Image(f"{i:032x}", 6))[0]
        assert first not in seen, (i, seen.get(first))
        seen[first] = i


def test_a_block_with_an_image_differs_from_the_same_tokens_without_one():
    tokens = [IMAGE_TOKEN] * BLOCK_SIZE
    assert block_hashes(tokens) != block_hashes(Image("img-a", BLOCK_SIZE))


def test_hash_depends_on_the_parent():
    tokens = text(BLOCK_SIZE, start=40)
    a = block_hashes(text(4), tokens)
    b = block_hashes(text(4, start=20), tokens)
    assert a[1] != b[1]
    assert hash_block(a[0], tokens) != hash_block(b[0], tokens)


def test_same_image_in_a_later_turn_shares_every_full_block_up_to_the_first_difference():
    turn1 = (text(5), Image("img-a", 8), text(3))
    answer = text(6, start=60)
    turn2 = (text(4, start=80), Image("img-a", 8), Image("img-b", 4), text(2))
    first_prompt, _ = build_prompt(*turn1)
    history = len(first_prompt) + len(answer)  # 22 tokens: 5 full blocks
    earlier = block_hashes(*turn1, answer)
    later = block_hashes(*turn1, answer, *turn2)
    assert len(earlier) == history // BLOCK_SIZE
    assert later[: len(earlier)] == earlier
    # The first turn as a request that generated the answer: the same keys, hashed as it decoded.
    tokens, features = build_prompt(*turn1)
    request = Request("r", tokens, features, SamplingParams(), BLOCK_SIZE)
    for token in answer:
        request.append_output_token(token)
    assert request.block_hashes == earlier


def test_hashes_extended_as_tokens_arrive_equal_hashes_computed_at_once():
    tokens, features = build_prompt(text(3), Image("img-a", 6), text(2))
    request = Request("r", tokens, features, SamplingParams(), BLOCK_SIZE)
    outputs = text(13, start=50)
    for token in outputs:
        request.append_output_token(token)
    at_once: list[bytes] = []
    extend_block_hashes(at_once, tokens + outputs, features, BLOCK_SIZE)
    assert request.block_hashes == at_once


def test_extending_hashes_keeps_the_ones_already_computed():
    tokens, features = build_prompt(text(3), Image("img-a", 6), text(7))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:9], features, BLOCK_SIZE)
    first = list(hashes)
    extend_block_hashes(hashes, tokens, features, BLOCK_SIZE)
    assert hashes[: len(first)] == first and len(hashes) == 4


# ---------------------------------------------------------------------------- property

IMAGE_LENGTHS = {"img-a": 3, "img-b": 5, "img-c": 2}  # one length per image, as in real life


@st.composite
def prompts(draw):
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 3)) == 0:
            name = draw(st.sampled_from(sorted(IMAGE_LENGTHS)))
            parts.append(Image(name, IMAGE_LENGTHS[name]))
        else:  # a small alphabet that includes the placeholder id, so equal prefixes are common
            parts.append(draw(st.lists(st.sampled_from([2, 3, IMAGE_TOKEN]), min_size=1, max_size=4)))
    return build_prompt(*parts)


def prefix_content(tokens, features, end):
    return tokens[:end], [(f.mm_hash, f.offset) for f in features if f.offset < end]


@settings(max_examples=200, deadline=None)
@given(prompts(), prompts(), st.sampled_from([1, 2, 4]))
def test_equal_block_hashes_mean_equal_tokens_and_images_from_the_start(a, b, block_size):
    (tokens_a, features_a), (tokens_b, features_b) = a, b
    hashes_a, hashes_b = [], []
    extend_block_hashes(hashes_a, tokens_a, features_a, block_size)
    extend_block_hashes(hashes_b, tokens_b, features_b, block_size)
    for i in range(min(len(hashes_a), len(hashes_b))):
        end = (i + 1) * block_size
        same = prefix_content(tokens_a, features_a, end) == prefix_content(tokens_b, features_b, end)
        assert (hashes_a[i] == hashes_b[i]) == same, i
