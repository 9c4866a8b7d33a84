"""Chat messages as the API receives them, made ready for the input processor: image `detail`
checked, and tools and tool turns put where the chat template can see them.

A chat template that knows tools (it mentions `tools`) gets them as the `tools` template
kwarg and the messages' `tool_calls` as they are (arguments as objects, as Hugging Face
templates expect). For a template that does not (some vision models' templates render no
tools), the tools are described in the system message and earlier calls and tool results are
written in the same `<tool_call>` / `<tool_response>` notation the model is asked to answer in.
"""

from __future__ import annotations

import json

from mmserve.entrypoints.openai.tools import TOOL_CALL_END, TOOL_CALL_START

IMAGE_DETAILS = ("auto", "high")
"""`image_url.detail` values served: both mean the server's pixel budget (its processor's
max_pixels), which is what `auto` picks for any image small enough and `high` asks for.
`low` (a fixed 512-pixel thumbnail at OpenAI) is refused: the preprocessor has no per-request
budget, and serving the full image under `low` would be a silent ignore."""


def check_image_detail(messages: list) -> None:
    """ValueError naming the part whose image_url.detail is not served."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            image = part.get("image_url") if isinstance(part, dict) else None
            detail = image.get("detail") if isinstance(image, dict) else None
            if detail is not None and detail not in IMAGE_DETAILS:
                raise ValueError(
                    f"messages[{i}].content[{j}].image_url.detail {detail!r} is not supported: use "
                    "'auto' or 'high' (both serve the image at the server's pixel budget)"
                )


def prepare_messages(messages: list, tools: list[dict] | None, template_knows_tools: bool) -> list:
    """The messages to render (see the module docstring)."""
    check_image_detail(messages)
    for index, message in enumerate(messages):
        _check_tool_calls(message, index)
    if template_knows_tools:
        return [_with_object_arguments(message) for message in messages]
    return messages_with_tools(messages, tools)


def _check_tool_calls(message, index: int) -> None:
    """An assistant message's `tool_calls` is a list of objects whose `function` is an object
    (a ValueError naming the message otherwise: it was an AttributeError, a 500)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if calls is None:
        return
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls")
    for position, call in enumerate(calls):
        if not isinstance(call, dict) or not isinstance(call.get("function", {}), dict | None):
            raise ValueError(f"{where}[{position}] must be an object with a 'function' object")


def _with_object_arguments(message):
    if not isinstance(message, dict) or not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call.get("function") or {})
        function["arguments"] = _arguments(function.get("arguments", "{}"))
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _arguments(arguments):
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ValueError("an assistant message's tool_calls[].function.arguments is not JSON") from None


def _format_call(call: dict) -> str:
    function = call.get("function") or {}
    arguments = _arguments(function.get("arguments", "{}"))
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def _tools_preamble(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "\n\n# Tools\n\nThese functions are available; call any that helps with the request.\n"
        f"<tools>\n{listed}\n</tools>\n\nTo call one, answer with a JSON object holding its name and "
        f'arguments between tags:\n{TOOL_CALL_START}\n{{"name": <function name>, "arguments": '
        f"<arguments as a JSON object>}}\n{TOOL_CALL_END}"
    )


def messages_with_tools(messages: list, tools: list[dict] | None) -> list:
    """Messages for a template that knows no tools: the tools described in the system message,
    assistant `tool_calls` written as `<tool_call>` blocks, `tool` results as user turns in
    `<tool_response>` blocks (consecutive results in one turn)."""
    rendered: list = []
    for message in messages:
        if not isinstance(message, dict):
            rendered.append(message)  # the input processor reports it
            continue
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_format_call(call) for call in message["tool_calls"])
            text = message.get("content") or ""
            rendered.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif role == "tool":
            result = f"<tool_response>\n{_text_of(message.get('content'))}\n</tool_response>"
            previous = rendered[-1] if rendered else None
            if isinstance(previous, dict) and previous.get("_tool_results"):
                previous["content"] += "\n" + result
            else:
                rendered.append({"role": "user", "content": result, "_tool_results": True})
        else:
            rendered.append({key: value for key, value in message.items() if key != "tool_calls"})
    for message in rendered:
        if isinstance(message, dict):
            message.pop("_tool_results", None)
    if tools:
        _add_to_system(rendered, _tools_preamble(tools))
    return rendered


def _text_of(content) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _add_to_system(messages: list, text: str) -> None:
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") == "system" and isinstance(first.get("content"), str):
        messages[0] = {**first, "content": first["content"] + text}
    else:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant." + text})
