"""Structured outputs and tool calls through the `openai` client, on the tiny random-weight
model: its text is noise, so whatever shape an answer has, the grammar gave it.

Strings in these schemas are bounded (maxLength, enum): a grammar allows a string of any length,
and noise closes a quote so rarely that an unbounded one runs to max_tokens (the same as a
real model asked for an unbounded string and told to ramble).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

S = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["score"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {"a": S, "b": {"type": "integer", "minimum": 5, "maximum": 9}},
        "required": ["a"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["kind", "r"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "label": S},
                    "required": ["id", "label"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "maybe": {"anyOf": [{"type": "null"}, {"type": "integer", "maximum": 3, "minimum": 0}]}
        },
        "required": ["maybe"],
    },
    {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}},
            }
        },
        "required": ["grid"],
    },
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "note": S},
        "required": ["level", "note"],
    },
    {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -40, "maximum": 50},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["temperature", "unit"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": S, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    {
        "type": "object",
        "properties": {
            "opt1": S,
            "opt2": {"type": "boolean"},
            "req": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["req"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {
            "shape": {"enum": ["square", "triangle"]},
            "sides": {"type": "integer", "minimum": 3, "maximum": 4},
            "filled": {"type": "boolean"},
        },
        "required": ["shape", "sides", "filled"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "name": S,
        },
        "required": ["matrix", "name"],
    },
]
MESSAGES = [{"role": "user", "content": "Describe the picture as JSON."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
            },
        },
    },
]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def streamed_contents(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


def check_schema(client, model, index: int, schema: dict) -> None:
    common = dict(
        model=model,
        messages=MESSAGES,
        n=2,
        temperature=1.0,
        seed=index,
        max_tokens=300,
        response_format=response_format(schema),
    )
    answer = client.chat.completions.create(**common)
    streamed = streamed_contents(client.chat.completions.create(**common, stream=True))
    for choice in answer.choices:
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert streamed[choice.index] == choice.message.content  # the same seed: the same answer


def test_twenty_json_schemas_always_validate_streamed_and_not(client, model):
    assert len(SCHEMAS) == 20
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda args: check_schema(client, model, *args), enumerate(SCHEMAS)))


def test_json_object_mode_answers_a_json_object(client, model):
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    choice = answer.choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":  # keys are unbounded strings: the object may run to max_tokens
        assert isinstance(json.loads(choice.message.content), dict)


def test_choice_and_regex_answers_match(client, model):
    choices = ["yes", "no", "maybe later"]
    for seed in range(3):
        answer = client.completions.create(
            model=model,
            prompt="Answer:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert answer.choices[0].text in choices
    pattern = r"[A-Z][a-z]{2}-[0-9]{3}"
    answer = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        n=2,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    for choice in answer.choices:
        assert re.fullmatch(pattern, choice.message.content)


def test_a_grammar_answer_matches(client, model):
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    answer = client.completions.create(
        model=model,
        prompt="Sum:",
        max_tokens=40,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", answer.choices[0].text)


def check_calls(calls, expected_names: set[str]) -> list[tuple[str, dict]]:
    assert calls
    parsed = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in expected_names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, TOOL_SCHEMAS[call.function.name])
        parsed.append((call.function.name, arguments))
    return parsed


def streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None]:
    """Tool-call deltas reassembled as a client does (by index, arguments concatenated)."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_validate_and_stream_the_same(client, model, tool_choice):
    names = {"add"} if isinstance(tool_choice, dict) else set(TOOL_SCHEMAS)
    for seed in range(3):
        common = dict(
            model=model,
            messages=[{"role": "user", "content": "What is 2 + 3?"}],
            tools=TOOLS,
            tool_choice=tool_choice,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        answer = client.chat.completions.create(**common)
        message = answer.choices[0].message
        calls = check_calls(message.tool_calls, names)
        assert answer.choices[0].finish_reason == "tool_calls"
        assert not message.content
        assert streamed_calls(client.chat.completions.create(**common, stream=True)) == (calls, "tool_calls")


def test_a_conversation_with_tool_turns_is_answered(client, model):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
