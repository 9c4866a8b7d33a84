"""Every request field is honoured or refused with a 400 naming it: the sampling controls
(logit_bias, allowed_token_ids, bad_words, prompt_logprobs, best_of, continuous usage), token
ids checked against the vocabulary before the engine sees them, /tokenize's options, and the
log line for a field no one defined."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from mmserve.frontend.tokenizer import Tokenizer
from mmserve.testing.reference import Reference

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4, "temperature": 0}
PROMPT = {"prompt": "The circle is", "max_tokens": 4, "temperature": 0}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
IMAGE = "data:image/png;base64,iVBORw0KGgo="

# (route, extra fields, the `param` the 400 must name)
REFUSED = [
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"verbosity": "low"}, "verbosity"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"store": True}, "store"),
    ("chat", {"metadata": {"k": "v"}}, "metadata"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("chat", {"prompt_cache_key": "k"}, "prompt_cache_key"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"echo": True}, "echo"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"1000000": 1}}, "logit_bias"),
    ("chat", {"stop_token_ids": [1000000], "min_tokens": 2}, "stop_token_ids"),
    ("completions", {"allowed_token_ids": [1000000]}, "allowed_token_ids"),
    ("chat", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs"),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "structured_outputs",
    ),
    (
        "chat",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "response_format",
    ),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ("chat", {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ("chat", {"priority": 1}, "priority"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
    ("completions", {"best_of": 3, "stream": True}, "best_of"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"stream": True, "stream_options": {"include_obfuscation": True}}, None),
]


@pytest.fixture(scope="module")
def tokenizer(model_path) -> Tokenizer:
    return Tokenizer(model_path)


def post(server, route: str, body: dict) -> httpx.Response:
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}.get(route, route)
    base = CHAT if route == "chat" else PROMPT if route == "completions" else {}
    return httpx.post(server.url + path, json={**base, **body}, timeout=60)


@pytest.mark.parametrize(("route", "fields", "param"), REFUSED)
def test_an_unsupported_or_invalid_field_is_a_400_naming_it(server, route, fields, param):
    response = post(server, route, fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert post(server, "chat", {}).status_code == 200  # and the server carries on


def test_image_detail_low_is_refused_naming_the_part(server):
    part = {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}}
    response = post(server, "chat", {"messages": [{"role": "user", "content": [part]}]})
    assert response.status_code == 400
    assert "messages[0].content[0].image_url.detail" in response.json()["error"]["message"]


def test_an_unknown_field_is_accepted_and_logged_once(server):
    for _ in range(2):
        assert post(server, "chat", {"made_up_field_x": 1}).status_code == 200
    assert server.log_path.read_text().count("'made_up_field_x'") == 1


def test_logit_bias_of_100_makes_a_token_the_greedy_answer(server, tokenizer):
    [token] = tokenizer.encode(" circle")
    response = post(server, "completions", {"logit_bias": {str(token): 100}, "max_tokens": 3}).json()
    assert response["choices"][0]["text"] == " circle" * 3


def test_allowed_token_ids_and_bad_words_shape_the_greedy_answer(server, tokenizer):
    allowed = tokenizer.encode(" red green blue")
    text = post(server, "completions", {"allowed_token_ids": allowed, "max_tokens": 6}).json()["choices"][0][
        "text"
    ]
    assert set(tokenizer.encode(text)) <= set(allowed)
    plain = post(server, "completions", {"max_tokens": 6}).json()["choices"][0]["text"]
    word = plain.split()[0]
    banned = post(server, "completions", {"bad_words": [word], "max_tokens": 6}).json()["choices"][0]["text"]
    assert word not in banned.split()


def test_prompt_logprobs_equal_transformers_log_softmax(server, model_path, tokenizer):
    prompt_ids = tokenizer.encode("The red circle is above the blue square.")
    body = {"prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 2}
    [choice] = post(server, "completions", body).json()["choices"]
    reference = Reference(model_path)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        logits = reference.model(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits[0].float()
    expected = logits.log_softmax(dim=-1)  # [P, V]: row p scores token p + 1
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for position, (token, entry) in enumerate(zip(prompt_ids[1:], entries[1:])):
        assert abs(entry[str(token)]["logprob"] - expected[position, token].item()) < 1e-4
        top = expected[position].topk(2)
        for rank, (value, top_token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entry[str(top_token)]["logprob"] - value) < 1e-4
            if top_token != token:
                assert entry[str(top_token)]["rank"] == rank


def test_best_of_returns_the_n_most_likely_of_its_samples(server):
    body = {"best_of": 4, "n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 5}
    best = post(server, "completions", body).json()
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["usage"]["completion_tokens"] == 20
    everyone = post(server, "completions", {**body, "best_of": None, "n": 4, "logprobs": 0}).json()["choices"]
    ranked = sorted(everyone, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert all(c["logprobs"] is None for c in best["choices"])


def test_continuous_usage_stats_count_up_on_every_chunk(server):
    body = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 5,
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**PROMPT, **body}, timeout=60
    ) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and all("usage" in chunk for chunk in chunks)


def test_n_choices_each_finish_once_in_a_stream(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        messages=CHAT["messages"],
        model=client.models.list().data[0].id,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=12,
        stream=True,
        stop=[" the", "e"],
    )
    finishes = [(c.index, c.finish_reason) for chunk in stream for c in chunk.choices if c.finish_reason]
    assert sorted(index for index, _ in finishes) == [0, 1, 2]


def test_tokenize_honours_add_generation_prompt_and_the_model_name(server, tokenizer):
    messages = CHAT["messages"]
    with_prompt = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    without = httpx.post(
        server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    )
    assert with_prompt == without.json()["tokens"] + tokenizer.encode("<|im_start|>assistant\n")
    wrong = httpx.post(server.url + "/tokenize", json={"model": "other", "prompt": "hi"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
