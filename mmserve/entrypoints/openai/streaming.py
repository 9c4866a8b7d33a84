"""One SSE stream builder for chat and text completions, fed by the output processor's deltas.

Streaming follows OpenAI and vLLM: for chat, a role-only chunk opens each choice once its
first token exists; content (or tool-call) deltas follow, then the finish_reason, once; with
`include_usage` a last chunk with empty choices carries usage (with `continuous_usage_stats`
every chunk carries usage so far); then `data: [DONE]`.

Each delta the engine side hands over is already only what is new for its choice, and text a
stop string could still begin in is held back there, so a stream is the non-streamed answer cut
into pieces: nothing here counts what was sent. What a choice's chunks look like is its
`ChoiceStream`'s part (chat or completion).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from mmserve.entrypoints.openai.errors import bad_request
from mmserve.entrypoints.openai.generation import Generation, chunk_base, client_error, sse
from mmserve.entrypoints.openai.logprobs_format import chat_logprobs, completion_logprobs
from mmserve.entrypoints.openai.tools import ToolCallParser
from mmserve.outputs import CompletionOutput


class ChoiceStream(Protocol):
    def chunks(self, delta: CompletionOutput) -> list[dict]:
        """The `choices` entries (one per chunk) for one delta of this choice."""


class CompletionChoiceStream:
    def __init__(self, index: int) -> None:
        self.index = index

    def chunks(self, delta: CompletionOutput) -> list[dict]:
        return [
            {
                "index": self.index,
                "text": delta.text,
                "logprobs": completion_logprobs(delta),
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
        ]


class ChatChoiceStream:
    """A chat choice: role first, then content or tool-call deltas (when tools are in play,
    `<tool_call>` blocks become tool_calls; text that may open one waits until it cannot)."""

    def __init__(self, index: int, top_logprobs: int, parse_tools: bool, parallel_calls: bool = True) -> None:
        self.index = index
        self.top_logprobs = top_logprobs
        self.tools = ToolCallParser(parallel_calls) if parse_tools else None
        self.opened = False

    def chunks(self, delta: CompletionOutput) -> list[dict]:
        choices = []
        if not self.opened:
            self.opened = True
            choices.append(self._choice({"role": "assistant", "content": ""}))
        content, calls = delta.text, []
        if self.tools is not None:
            content, calls = self.tools.feed(delta.text, final=delta.finish_reason is not None)
        message: dict = {"content": content} if content else {}
        if calls:
            first = self.tools.num_calls - len(calls)
            message["tool_calls"] = [{"index": first + i, **call.as_dict()} for i, call in enumerate(calls)]
        finish_reason = delta.finish_reason
        if finish_reason == "stop" and self.tools is not None and self.tools.num_calls:
            finish_reason = "tool_calls"
        logprobs = chat_logprobs(delta, self.top_logprobs)
        if message or logprobs or finish_reason:
            choice = self._choice(message, logprobs, finish_reason)
            if finish_reason:
                choice["stop_reason"] = delta.stop_reason
            choices.append(choice)
        return choices

    def _choice(self, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


async def stream_response(
    generation: Generation,
    kind: str,
    new_choice: Callable[[int], ChoiceStream],
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[str]:
    """The SSE events of a generation; `kind` is the chunks' `object` ("chat.completion.chunk"
    or "text_completion"), `new_choice(index)` starts each choice's formatter."""
    base = chunk_base(generation, "chatcmpl" if kind.startswith("chat") else "cmpl", kind)
    choices: dict[int, ChoiceStream] = {}
    try:
        async for prompt_index, delta in generation.merged_stream():
            if delta.error:
                raise bad_request(delta.error)
            for completion in delta.outputs:
                index = prompt_index * generation.params.n + completion.index
                if index not in choices:
                    choices[index] = new_choice(index)
                for entry in choices[index].chunks(completion):
                    chunk = {**base, "choices": [entry]}
                    if continuous_usage:
                        chunk["usage"] = generation.usage()
                    yield sse(chunk)
        if include_usage:
            # `timing` (mmserve's, beside OpenAI's fields): the server's own token timing
            yield sse({**base, "choices": [], "usage": generation.usage(), "timing": generation.timing()})
    except Exception as e:
        yield sse(client_error(e).body())
    yield sse("[DONE]")
