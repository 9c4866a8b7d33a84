"""Streamed deltas add up to the whole answer even when the answer grows while a chunk is out.

A request's snapshots share one live CompletionOutput with the output processor, which keeps
appending while the stream generator waits for the client to take a chunk. The generator once
counted text as sent after that wait, so whatever arrived during it was never sent (seen as a
missing word in the chat page's answer, one request in four on the tiny model).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from mmserve.entrypoints.openai.serving import chat_stream, completion_stream
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SamplingParams

PIECES = ["Hello", ",", " world", " and", " more", "."]


class GrowingGeneration:
    """A generation whose single completion also grows while the consumer holds a chunk:
    `grow_between_reads()` appends a piece, as the engine's output loop would."""

    def __init__(self) -> None:
        self.params = SamplingParams(max_tokens=len(PIECES))
        self.id_base, self.created = "test", 0
        self.state = SimpleNamespace(served_model_name="m")
        self.completion = CompletionOutput(index=0, text="", token_ids=[])
        self.output = RequestOutput("r", None, [1, 2, 3], [self.completion], finished=False)
        self.remaining = list(PIECES)
        self.unreported = 0  # growths not yet in a yielded snapshot

    def grow_between_reads(self) -> None:
        if self.remaining:
            self._append(self.remaining.pop(0))

    def _append(self, piece: str) -> None:
        self.completion.text += piece
        self.completion.token_ids.append(len(self.completion.token_ids))
        self.unreported += 1
        if not self.remaining:
            self.completion.finish_reason = "length"
            self.output.finished = True

    async def merged_stream(self):
        """A snapshot for every growth, as the output processor sends one per change."""
        while True:
            if not self.unreported:
                self.grow_between_reads()
            self.unreported = 0
            yield 0, self.output
            if self.output.finished and not self.unreported:
                return


def streamed_text(stream, generation: GrowingGeneration, field: str) -> str:
    async def read() -> str:
        text = ""
        async for event in stream:
            data = event.removeprefix("data: ").strip()
            if data != "[DONE]":
                for choice in json.loads(data)["choices"]:
                    text += choice["delta"].get("content", "") if field == "delta" else choice["text"]
            generation.grow_between_reads()  # the engine moves on while the client reads
        return text

    # A thread of its own: pytest-playwright leaves an event loop running on the main thread.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, read()).result()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_piece_of_a_growing_answer_is_streamed(kind):
    generation = GrowingGeneration()
    if kind == "chat":
        text = streamed_text(chat_stream(generation, include_usage=False), generation, "delta")
    else:
        text = streamed_text(completion_stream(generation, include_usage=False), generation, "text")
    assert text == "".join(PIECES)
