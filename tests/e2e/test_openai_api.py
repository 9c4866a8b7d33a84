"""The OpenAI-compatible server driven by the real `openai` client."""

from __future__ import annotations

import base64
import re
import time

import httpx
import openai
import pytest

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import png_bytes, synthetic_image


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_message(text: str, seed: int, size=(224, 168)) -> list[dict]:
    image = synthetic_image(*size, seed=seed)
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": data_url(image), "detail": "high"}},
            ],
        }
    ]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline(model_path):
    with LLM(model_path, max_num_batched_tokens=64, num_kv_blocks=512) as llm:
        yield llm


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M):
        total += float(match.group(1))
    return total


def test_models_lists_the_served_model(client, model_path):
    [model] = client.models.list().data
    assert model.id == model_path.name
    assert model.owned_by == "mmserve"
    assert model.model_extra["max_model_len"] == 4096


def test_image_chat_matches_the_offline_engine_streaming_and_not(client, model_name, offline):
    messages = image_message("What colour is the circle?", seed=1)
    [expected] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20))
    response = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=20
    )
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model_name,
        messages=messages,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        expected.outputs[0].token_ids
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt a moment ago


def test_n2_with_seed_gives_two_reproducible_choices(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=image_message("Describe.", seed=2),
        n=2,
        seed=11,
        temperature=1.0,
        max_tokens=12,
    )
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts[0] != texts[1]
    assert [c.message.content for c in second.choices] == texts
    assert (
        first.usage.completion_tokens
        == sum(len(c.message.content) > 0 for c in first.choices) * 0 + first.usage.completion_tokens
    )


def test_logprobs_match_the_offline_engine(client, model_name, offline):
    messages = [{"role": "user", "content": "Name three colours."}]
    [expected] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    response = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == len(expected.outputs[0].token_ids)
    for got, token_id, entry in zip(content, expected.outputs[0].token_ids, expected.outputs[0].logprobs):
        assert got.logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert len(got.top_logprobs) == 3
        assert got.top_logprobs[0].logprob >= got.top_logprobs[1].logprob >= got.top_logprobs[2].logprob


def test_stop_string_ends_the_answer_before_it(client, model_name, offline):
    messages = [{"role": "user", "content": "Tell me a story."}]
    [free] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=30))
    text = free.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    response = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=30, stop=[stop]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_text_completions_route(client, model_name, offline):
    [expected] = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10))
    response = client.completions.create(
        model=model_name, prompt="Once upon a time", temperature=0, max_tokens=10
    )
    assert response.choices[0].text == expected.outputs[0].text
    streamed = client.completions.create(
        model=model_name, prompt="Once upon a time", temperature=0, max_tokens=10, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.outputs[0].text


def test_tokenize_and_detokenize(server, model_name):
    tokens = httpx.post(server.url + "/tokenize", json={"model": model_name, "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(
        server.url + "/detokenize", json={"model": model_name, "tokens": tokens["tokens"]}
    ).json()
    assert text["prompt"] == "Hello world"


def ttft(client, model_name, messages) -> tuple[float, str]:
    start = time.perf_counter()
    first = None
    text = ""
    for chunk in client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=12, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return first, text


def test_multi_turn_chat_resending_its_image_hits_the_prefix_cache(server, client, model_name):
    """As chat UIs do: every turn resends the whole history with the image as a data URL."""
    turn1_ttft, turn2_ttft = [], []
    for seed in range(3):
        messages = image_message(
            "What is in this picture?", seed=100 + seed, size=(448, 448)
        )  # 256 image tokens
        t1, answer = ttft(client, model_name, messages)
        hits_before = metric(server, "mmserve:prefix_cache_hits_total")
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me more."}]
        t2, _ = ttft(client, model_name, messages)
        assert metric(server, "mmserve:prefix_cache_hits_total") - hits_before >= 256
        turn1_ttft.append(t1)
        turn2_ttft.append(t2)
    assert sum(turn2_ttft) < sum(turn1_ttft), (turn1_ttft, turn2_ttft)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_priority_under_first_come_first_served_scheduling_is_refused(client, model_name, route):
    """The server runs the default fcfs policy: a priority would be silently ignored, so it is a
    400 naming the field; priority 0 (the default) is accepted."""

    def create(priority: int):
        if route == "chat":
            messages = [{"role": "user", "content": "hi"}]
            return client.chat.completions.create(
                model=model_name, messages=messages, max_tokens=2, extra_body={"priority": priority}
            )
        return client.completions.create(
            model=model_name, prompt="hi", max_tokens=2, extra_body={"priority": priority}
        )

    with pytest.raises(openai.BadRequestError) as refused:
        create(1)
    assert refused.value.status_code == 400
    assert refused.value.param == "priority"
    assert "priority" in refused.value.message
    assert create(0).choices
