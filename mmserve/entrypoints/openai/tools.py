"""Tool calls in the Hermes format (vLLM's `hermes` parser): tools into the prompt,
`<tool_call>` blocks out of the answer.

The model calls a tool by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
`ToolCallParser` splits an answer (whole, or streamed piece by piece: the same parser serves
both, so a stream reassembles to exactly the non-streamed calls) into content and calls.
`tool_choice` "required" or a named function is enforced by a grammar (`tool_call_grammar`,
an xgrammar structural tag), so the arguments always parse and match the function's schema.

How tools reach the prompt is chat_messages.py's part.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from mmserve.frontend.output_processor import held_back_chars

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _parse_call(body: str) -> ToolCall | None:
    try:
        # strict=False admits raw control characters inside strings, which the forcing grammar
        # can let through (xgrammar 0.2.9's rule for a string with maxLength); the arguments
        # are written out again below, escaped
        call = json.loads(body, strict=False)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call["name"], text)


class ToolCallParser:
    """Split text fed piece by piece into content and tool calls. Text that may be the start
    of `<tool_call>` waits for the next piece; a block that does not parse as a call stays
    content, as written. Whitespace after a call is a separator, not content, unless more text
    follows it. With `parallel` False (OpenAI's parallel_tool_calls) calls after the first are
    dropped."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self._buffer = ""
        self._in_call = False
        self._pending_space = ""  # whitespace after a call, held until text shows it is content
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """(content released by this piece, calls completed by it); `final` flushes everything."""
        self._buffer += text
        content, calls = [], []
        while True:
            if not self._in_call:
                start = self._buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else held_back_chars(self._buffer, [TOOL_CALL_START])
                    content.append(self._content(self._buffer[: len(self._buffer) - keep]))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._content(self._buffer[:start]))
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._in_call = True
            end = self._buffer.find(TOOL_CALL_END)
            if end < 0:
                if final:  # an unfinished block is text
                    content.append(self._content(TOOL_CALL_START + self._buffer))
                    self._buffer = ""
                break
            body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END) :]
            self._in_call = False
            call = _parse_call(body)
            if call is None:
                content.append(self._content(TOOL_CALL_START + body + TOOL_CALL_END))
            elif self.parallel or not self.num_calls:
                calls.append(call)
                self.num_calls += 1
                self._pending_space = ""
        return "".join(content), calls

    def _content(self, text: str) -> str:
        if not self.num_calls:
            return text
        if not text.strip():
            self._pending_space += text
            return ""
        text, self._pending_space = self._pending_space + text, ""
        return text


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; content is None when the answer is only calls."""
    content, calls = ToolCallParser(parallel).feed(text, final=True)
    return (content or None) if calls else content, calls


def check_tools(tools: list[dict], tool_choice: str | dict) -> str | None:
    """Validate `tools` and `tool_choice` (ValueError naming the field); the name of the
    function a named tool_choice forces, if any."""
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(name)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or name not in names:
            raise ValueError(f"tool_choice names no function in tools: {tool_choice!r}")
        return name
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice 'required' needs tools")
    return None


def tool_call_grammar(tools: list[dict], forced: str | None, parallel: bool) -> str:
    """An xgrammar structural tag (JSON text) that admits only tool calls: one call of
    `forced`, or at least one call of any of `tools` (only one unless `parallel`)."""
    tags = [
        {
            "type": "tag",
            "begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(function["name"])}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": function.get("parameters") or {"type": "object"},
                "max_whitespace_cnt": 1,
            },
            "end": f"}}\n{TOOL_CALL_END}",
        }
        for function in (tool["function"] for tool in tools)
        if forced is None or function["name"] == forced
    ]
    if forced is not None:
        grammar = tags[0]
    else:
        grammar = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    return json.dumps({"type": "structural_tag", "format": grammar}, ensure_ascii=False)
