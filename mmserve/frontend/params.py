"""A request's SamplingParams made ready for the engine, with what only the frontend can do:
bad words turned into token sequences, every token id checked against the vocabulary, a
structured-output spec checked to make a grammar; and its prompt truncated
(truncate_prompt_tokens). Errors are ValueErrors naming the field
(TokenIdError for token ids), which the API turns into 400s: the engine never sees such a
request."""

from __future__ import annotations

import dataclasses

from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.sampling_params import SamplingParams
from mmserve.structured_output.grammars import check_grammar


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token sequence alone and after a space (the same word mid-sentence is
    another sequence in a byte-level BPE vocabulary), without repeats."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def prepare_params(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """A copy of `params` ready for the engine (see the module docstring). Checking a grammar
    imports xgrammar the first time: callers on an event loop run this in a thread."""
    params = params.clone()
    if params.bad_words:
        params.bad_words_token_ids = bad_words_token_ids(tokenizer, params.bad_words)
    params.check_token_ids(tokenizer.vocab_size)
    if params.structured_outputs is not None:
        check_grammar(params.structured_outputs)
    return params


def truncate_prompt(prompt: ProcessedPrompt, keep: int | None) -> ProcessedPrompt:
    """The prompt's last `keep` tokens (SamplingParams.truncate_prompt_tokens); images before
    the cut are dropped, and a cut through an image's placeholders is a ValueError."""
    cut = len(prompt.token_ids) - keep if keep is not None else 0
    if cut <= 0:
        return prompt
    features = []
    for feature in prompt.features:
        if feature.offset < cut < feature.offset + feature.length:
            raise ValueError(f"truncate_prompt_tokens={keep} would cut through an image's placeholder tokens")
        if feature.offset >= cut:
            features.append(dataclasses.replace(feature, offset=feature.offset - cut))
    # the same pixels and holds: releasing either prompt releases them
    return dataclasses.replace(prompt, prompt=None, token_ids=prompt.token_ids[cut:], features=features)
