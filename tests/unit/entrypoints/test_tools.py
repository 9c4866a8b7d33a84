"""Qwen tool calls: parsing whole answers and streamed pieces alike, the forcing grammar, and
tool turns rendered for a chat template that knows no tools."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from hypothesis import given
from hypothesis import strategies as st

from mmserve.entrypoints.openai.chat_messages import check_image_detail, messages_with_tools
from mmserve.entrypoints.openai.tools import ToolCallParser, check_tools, parse_tool_calls, tool_call_grammar
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.testing.checkpoints import checkpoint

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
]
ANSWER = (
    'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
)


def test_a_whole_answer_splits_into_content_and_calls():
    content, calls = parse_tool_calls(ANSWER)
    assert content == "Let me add.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}), ("add", {"a": 2})]
    assert parse_tool_calls("no calls <tool_call>{broken</tool_call>") == (
        "no calls <tool_call>{broken</tool_call>",
        [],
    )


@given(st.lists(st.integers(1, len(ANSWER) - 1), max_size=20))
def test_streamed_pieces_give_the_same_calls_and_content(cuts):
    bounds = sorted(set(cuts))
    pieces = [ANSWER[a:b] for a, b in zip([0, *bounds], [*bounds, len(ANSWER)])]
    parser, content, calls = ToolCallParser(), "", []
    for i, piece in enumerate(pieces):
        text, new = parser.feed(piece, final=i == len(pieces) - 1)
        assert "<tool" not in text
        content, calls = content + text, calls + new
    whole_content, whole_calls = parse_tool_calls(ANSWER)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_the_forcing_grammar_admits_exactly_the_tool_call_format():
    tokenizer_info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"])
    compiler = xgr.GrammarCompiler(tokenizer_info)
    for forced, text, ok in [
        ("add", '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>', True),
        ("add", '<tool_call>\n{"name": "add", "arguments": {"b": 3}}\n</tool_call>', False),
        (None, ANSWER.split("\n", 1)[1], True),
        (None, "plain text", False),
    ]:
        grammar = compiler.compile_structural_tag(tool_call_grammar(TOOLS, forced, parallel=True))
        matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


def test_every_call_the_grammar_admits_parses_with_its_arguments_escaped():
    """xgrammar's rule for a string with maxLength admits raw control characters (0.2.9:
    [^"\\\r\n]), which strict JSON refuses: such a call must still come out as a call, its
    arguments valid JSON."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                },
            },
        }
    ]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": ",\x19bb c"}}\n</tool_call>'
    tokenizer_info = xgr.TokenizerInfo([chr(c) for c in range(0, 127)])
    grammar = xgr.GrammarCompiler(tokenizer_info).compile_structural_tag(tool_call_grammar(tools, None, True))
    matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    assert matcher.accept_string(text) and matcher.is_completed()  # the grammar lets it through
    content, calls = parse_tool_calls(text)
    assert not content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": ",\x19bb c"})]
    assert "\x19" not in calls[0].arguments  # escaped as \u0019


def test_tools_and_tool_choice_are_checked():
    assert check_tools(TOOLS, {"type": "function", "function": {"name": "add"}}) == "add"
    with pytest.raises(ValueError, match="names no function"):
        check_tools(TOOLS, {"type": "function", "function": {"name": "sub"}})
    with pytest.raises(ValueError, match="needs tools"):
        check_tools([], "required")
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        check_tools([{"type": "function", "function": {"name": "a b"}}], "auto")


def test_tool_turns_render_through_a_template_without_tool_support():
    messages = [
        {"role": "user", "content": "add 1"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "1"},
        {"role": "tool", "tool_call_id": "d", "content": "2"},
    ]
    rendered = messages_with_tools(messages, TOOLS)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert '"name": "add"' in rendered[0]["content"] and "<tools>" in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert (
        rendered[3]["content"] == "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    )
    text = Tokenizer(checkpoint("qwen2_vl")).apply_chat_template(rendered)
    assert "<tool_call>" in text and "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_image_detail_low_is_refused_and_auto_or_high_pass():
    part = lambda detail: {"type": "image_url", "image_url": {"url": "x", "detail": detail}}
    check_image_detail([{"role": "user", "content": [part("auto"), part("high")]}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]\.image_url\.detail"):
        check_image_detail([{"role": "user", "content": [part("high"), part("low")]}])


def test_without_parallel_tool_calls_only_the_first_call_is_returned():
    content, calls = parse_tool_calls(ANSWER, parallel=False)
    assert content == "Let me add.\n" and [json.loads(c.arguments) for c in calls] == [{"a": 1}]
