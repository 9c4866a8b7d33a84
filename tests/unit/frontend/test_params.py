"""The frontend's preparation of a request: bad words as token sequences, token ids checked,
grammars checked, prompts truncated."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.frontend.params import prepare_params, truncate_prompt
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.protocol import MultiModalFeature
from mmserve.sampling_params import SamplingParams, StructuredOutputsParams, TokenIdError
from mmserve.testing.checkpoints import checkpoint


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(checkpoint("qwen2_vl"))


def test_bad_words_become_their_token_sequences_alone_and_after_a_space(tokenizer):
    params = prepare_params(SamplingParams(bad_words=["circle"]), tokenizer)
    assert params.bad_words_token_ids == [tokenizer.encode("circle"), tokenizer.encode(" circle")]


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("stop_token_ids", SamplingParams(stop_token_ids=[10**6])),
        ("logit_bias", SamplingParams(logit_bias={10**6: 1.0})),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[3, 10**6])),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(tokenizer, field, params):
    with pytest.raises(TokenIdError) as error:
        prepare_params(params, tokenizer)
    assert error.value.field == field


def test_a_spec_that_makes_no_grammar_is_refused(tokenizer):
    with pytest.raises(ValueError, match="invalid structured_outputs regex"):
        prepare_params(SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), tokenizer)


def test_truncation_keeps_the_last_tokens_and_moves_images_or_refuses_to_cut_one():
    image = MultiModalFeature("h", offset=6, length=2, grid_thw=(1, 2, 4))
    prompt = ProcessedPrompt("text", list(range(10)), [image], arrays={"h": np.zeros((8, 3))})
    kept = truncate_prompt(prompt, 5)
    assert kept.token_ids == [5, 6, 7, 8, 9] and kept.features[0].offset == 1
    assert kept.arrays is prompt.arrays, "the same pixels"
    assert truncate_prompt(prompt, 20) is prompt and truncate_prompt(prompt, None) is prompt
    assert truncate_prompt(prompt, 2).features == []
    with pytest.raises(ValueError, match="cut through an image"):
        truncate_prompt(prompt, 3)
