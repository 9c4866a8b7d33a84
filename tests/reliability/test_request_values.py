"""Issue 20, classes 1 and 2: a request's values never reach the engine unchecked, and a stream
with n > 1 gives each choice its finish_reason exactly once.

Class 1 was: `stop_token_ids: [1000000]` with `min_tokens` raised IndexError inside the engine
step (logged as a traceback every step, answered 400 "internal error while running the
model"); `logit_bias` ids were not checked at all. Now every token id is checked against the
vocabulary in the API server: a 400 naming the field, and the engine log stays clean.
Class 2 was: a finished choice's finish chunk repeated on every later snapshot (4 finish
chunks for 3 choices, in completions streams too).
"""

from __future__ import annotations

import json

import httpx
import pytest
from reliability_util import CHAT, Case, assert_openai_error, assert_still_serving, chat

from mmserve.frontend.tokenizer import Tokenizer

COMPLETIONS = "/v1/completions"


def completion(**extra) -> dict:
    return {"prompt": "Say something.", "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def vocab_size(model_path) -> int:
    return Tokenizer(model_path).vocab_size


# (case, the field its error must name). Bodies that need the vocabulary size are built in the
# test: `VOCAB` in a list stands for it.
VOCAB = object()

TOKEN_IDS: list[tuple[Case, str]] = [
    (
        Case("stop_token_id_1e6_with_min_tokens", chat("hi", stop_token_ids=[1_000_000], min_tokens=2), 400),
        "stop_token_ids",
    ),
    (
        Case("stop_token_id_at_vocab_size", chat("hi", stop_token_ids=[VOCAB], min_tokens=1), 400),
        "stop_token_ids",
    ),
    (Case("stop_token_id_negative", chat("hi", stop_token_ids=[-1], min_tokens=1), 400), "stop_token_ids"),
    (Case("stop_token_id_after_good_ones", chat("hi", stop_token_ids=[0, 1, 2**31]), 400), "stop_token_ids"),
    (Case("logit_bias_id_1e6", chat("hi", logit_bias={"1000000": 5}), 400), "logit_bias"),
    (Case("logit_bias_id_at_vocab_size", chat("hi", logit_bias={VOCAB: -100}), 400), "logit_bias"),
    (Case("logit_bias_negative_id", chat("hi", logit_bias={"-3": 1}), 400), "logit_bias"),
    (Case("logit_bias_id_not_a_number", chat("hi", logit_bias={"the": 1}), 400), "logit_bias"),
    (Case("logit_bias_id_5000_digits", chat("hi", logit_bias={"9" * 5000: 1}), 400), "logit_bias"),
    (Case("logit_bias_value_out_of_range", chat("hi", logit_bias={"1": 1e9}), 400), "logit_bias"),
    (Case("allowed_token_id_1e6", chat("hi", allowed_token_ids=[1_000_000]), 400), "allowed_token_ids"),
    (Case("allowed_token_id_negative", chat("hi", allowed_token_ids=[5, -7]), 400), "allowed_token_ids"),
    (
        Case(
            "completions_stop_token_id_1e6",
            completion(stop_token_ids=[1_000_000], min_tokens=2),
            400,
            route=COMPLETIONS,
        ),
        "stop_token_ids",
    ),
    (
        Case(
            "completions_logit_bias_at_vocab_size", completion(logit_bias={VOCAB: 3}), 400, route=COMPLETIONS
        ),
        "logit_bias",
    ),
    (
        Case(
            "completions_allowed_token_id_at_vocab_size",
            completion(allowed_token_ids=[VOCAB]),
            400,
            route=COMPLETIONS,
        ),
        "allowed_token_ids",
    ),
    (Case("prompt_token_id_1e6", completion(prompt=[1, 2, 1_000_000]), 400, route=COMPLETIONS), "prompt"),
    (Case("prompt_token_id_negative", completion(prompt=[[5], [-1]]), 400, route=COMPLETIONS), "prompt"),
    (
        Case(
            "streamed_stop_token_id_1e6",
            chat("hi", stop_token_ids=[1_000_000], min_tokens=2, stream=True),
            400,
        ),
        "stop_token_ids",
    ),
]


def _fill(value: object, vocab_size: int) -> object:
    """`value` with every VOCAB (list item or dict key) replaced by the vocabulary size."""
    if value is VOCAB:
        return vocab_size
    if isinstance(value, dict):
        return {(str(vocab_size) if k is VOCAB else k): _fill(v, vocab_size) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(item, vocab_size) for item in value]
    return value


@pytest.mark.parametrize("case,field", TOKEN_IDS, ids=[c.id for c, _ in TOKEN_IDS])
def test_a_token_id_outside_the_vocabulary_is_a_400_naming_its_field(
    hardened, valid_answer, vocab_size, case: Case, field: str
):
    log_before = len(hardened.server.log_path.read_bytes())
    response = hardened.post(case.route, _fill(case.body, vocab_size))
    error = assert_openai_error(response, 400, field)
    assert error["param"] == field, error
    assert "internal error" not in error["message"]
    assert_still_serving(hardened, valid_answer)
    log = hardened.server.log_path.read_bytes()[log_before:].decode(errors="replace")
    assert "Traceback" not in log and "IndexError" not in log, log[-2000:]


def test_the_last_token_of_the_vocabulary_is_accepted(hardened, valid_answer, vocab_size):
    """The bound is exact: vocab_size - 1 is a token (a positive control for the cases above)."""
    body = chat("hi", stop_token_ids=[vocab_size - 1], logit_bias={str(vocab_size - 1): -100}, min_tokens=1)
    response = hardened.post(CHAT, body)
    assert response.status_code == 200, response.text
    assert_still_serving(hardened, valid_answer)


# ------------------------------------------------------------------------ class 2: finish once


def _events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


STREAMS = [
    (
        "chat_n3_sampled",
        CHAT,
        {**chat("Tell me a story."), "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 3},
        3,
    ),
    ("chat_n4_greedy_eos", CHAT, {**chat("hi"), "n": 4, "max_tokens": 16, "temperature": 0}, 4),
    (
        "completions_n3_sampled",
        COMPLETIONS,
        completion(n=3, max_tokens=12, temperature=1.0, seed=5, prompt="Once upon a time"),
        3,
    ),
    (
        "completions_2_prompts_n2",
        COMPLETIONS,
        completion(n=2, max_tokens=8, temperature=1.0, seed=7, prompt=["a", "b"]),
        4,
    ),
    (
        "chat_n2_with_usage",
        CHAT,
        {**chat("hi"), "n": 2, "max_tokens": 6, "temperature": 0, "stream_options": {"include_usage": True}},
        2,
    ),
]


@pytest.mark.parametrize("name,route,body,choices", STREAMS, ids=[s[0] for s in STREAMS])
def test_each_streamed_choice_finishes_exactly_once(hardened, valid_answer, name, route, body, choices):
    streamed = hardened.post(route, {**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = _events(streamed)
    assert not [e for e in events if "error" in e], events[-2:]
    finishes = [c["index"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert sorted(finishes) == list(range(choices)), finishes
    # Nothing follows a choice's finish chunk for that choice.
    finished: set[int] = set()
    for event in events:
        for choice in event.get("choices", []):
            assert choice["index"] not in finished, (choice, "after its finish chunk")
            if choice.get("finish_reason"):
                finished.add(choice["index"])
    # The stream is the answer cut into pieces: the same texts as the same request unstreamed.
    unstreamed = {key: value for key, value in body.items() if key != "stream_options"}
    whole = hardened.post(route, unstreamed).json()["choices"]
    key = "text" if route == COMPLETIONS else "delta"
    for choice in whole:
        pieces = [
            (c.get("text") if key == "text" else c["delta"].get("content")) or ""
            for e in events
            for c in e.get("choices", [])
            if c["index"] == choice["index"]
        ]
        expected = choice["text"] if key == "text" else choice["message"]["content"]
        assert "".join(pieces) == expected, (choice["index"], pieces)
    assert_still_serving(hardened, valid_answer)
