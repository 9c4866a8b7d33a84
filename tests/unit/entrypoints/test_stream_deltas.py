"""Streams are the non-streamed answer cut into pieces: the output processor's deltas add up to
its final answer whatever the text, the stop strings and the way detokenising splits it, and
a streamed text never shows a stop string (not even the start of one that later completes).
The SSE builder then sends each choice's finish_reason exactly once, n > 1 included.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.entrypoints.openai.generation import Generation
from mmserve.entrypoints.openai.streaming import ChatChoiceStream, CompletionChoiceStream, stream_response
from mmserve.frontend.output_processor import OutputProcessor, held_back_chars
from mmserve.outputs import RequestOutputKind
from mmserve.protocol import EngineCoreOutput
from mmserve.sampling_params import SamplingParams
from mmserve.testing.run_apart import run_apart


class PieceTokenizer:
    """Token i decodes to pieces[i]: the test chooses how detokenising splits the text."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode_stream(self, skip_special_tokens: bool = True):
        return SimpleNamespace(step=lambda token: self.pieces[token])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[t] for t in token_ids)


def run(pieces: list[str], steps: list[int], params: SamplingParams, kind: RequestOutputKind) -> list:
    """Feed tokens 0..len(pieces)-1 in steps of the given sizes (the last one finishes by
    length); the request's outputs, stopping where the processor asks to abort."""
    processor = OutputProcessor(PieceTokenizer(pieces))
    processor.add_request("r", None, [0], params, kind)
    results, token = [], 0
    for size in steps:
        new = list(range(token, min(token + size, len(pieces))))
        token += len(new)
        finish = "length" if token >= len(pieces) else None
        outputs, to_abort = processor.process_outputs([EngineCoreOutput("r", new, finish_reason=finish)])
        results += outputs
        if to_abort or finish:
            break
    return results


texts = st.text(alphabet="abAB ", min_size=1, max_size=40)


@st.composite
def cases(draw):
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if a < b]
    stops = draw(st.lists(st.text(alphabet="abAB ", min_size=1, max_size=4), min_size=1, max_size=3))
    if draw(st.booleans()):  # often a stop string that does occur
        start = draw(st.integers(0, len(text) - 1))
        stops.append(text[start : start + draw(st.integers(1, 4))])
    steps = draw(st.lists(st.integers(1, 4), min_size=len(pieces), max_size=len(pieces)))
    return pieces, stops, steps


@settings(max_examples=300, deadline=None)
@given(cases(), st.booleans())
def test_streamed_text_is_the_final_text_and_never_shows_a_stop_string(case, include_stop):
    pieces, stops, steps = case
    params = SamplingParams(stop=stops, include_stop_str_in_output=include_stop, max_tokens=None)
    [final] = run(pieces, steps, params, RequestOutputKind.FINAL_ONLY)
    deltas = run(pieces, steps, params, RequestOutputKind.DELTA)
    streamed = "".join(c.text for d in deltas for c in d.outputs)
    assert streamed == final.outputs[0].text
    finishes = [c.finish_reason for d in deltas for c in d.outputs if c.finish_reason]
    assert finishes == [final.outputs[0].finish_reason]
    if not include_stop:
        assert not any(stop in streamed for stop in stops)
    # Every delta's text was safe to send when it was sent: no later stop string starts in it.
    sent = 0
    for delta in deltas:
        sent += sum(len(c.text) for c in delta.outputs)
        assert sent <= len(final.outputs[0].text)


def test_a_possible_stop_string_waits_and_is_released_when_ruled_out():
    params = SamplingParams(stop=["END"], max_tokens=None)
    deltas = run(["Hello ", "E", "N", "D"], [1, 1, 1, 1], params, RequestOutputKind.DELTA)
    assert [c.text for d in deltas for c in d.outputs] == ["Hello ", "", "", ""]
    deltas = run(["Hello ", "E", "N", "o"], [1, 1, 1, 1], params, RequestOutputKind.DELTA)
    assert "".join(c.text for d in deltas for c in d.outputs) == "Hello ENo"
    assert held_back_chars("xEN", ["END"]) == 2 and held_back_chars("xEND!", ["END"]) == 0


# ------------------------------------------------------------------------------- SSE


class FakeGeneration(Generation):
    """A Generation whose deltas come from a list instead of the engine."""

    def __init__(self, params: SamplingParams, deltas: list) -> None:
        state = SimpleNamespace(
            served_model_name="m", metrics=SimpleNamespace(observe_request=lambda *a: None)
        )
        self.state, self.params, self.prompts = state, params, [SimpleNamespace(token_ids=[1, 2])]
        self.id_base, self.created, self.start = "test", 0, 0.0
        self.num_completion_tokens, self.num_cached_tokens, self.times = 0, {}, {}
        self._deltas = deltas

    async def merged_stream(self):
        for delta in self._deltas:
            self._observe(0, delta)
            yield 0, delta


def three_choices_finishing_apart() -> list:
    """Deltas of an n = 3 request whose choices finish at different steps."""
    processor = OutputProcessor(PieceTokenizer(["a", "b", "c", "d"]))
    params = SamplingParams(n=3, max_tokens=None)
    ids = [
        engine_id for engine_id, _ in processor.add_request("r", None, [0], params, RequestOutputKind.DELTA)
    ]
    deltas = []
    for step in range(4):
        outputs = [
            EngineCoreOutput(engine_id, [step], finish_reason="length" if step == index + 1 else None)
            for index, engine_id in enumerate(ids)
            if step <= index + 1
        ]
        deltas += processor.process_outputs(outputs)[0]
    return deltas


def sse_chunks(stream) -> list[dict]:
    async def read():
        return [event async for event in stream]

    events = run_apart(read())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def test_each_choice_finishes_once_in_chat_and_completion_streams():
    params = SamplingParams(n=3, max_tokens=None)
    for kind, choice in (("chat.completion.chunk", ChatChoiceStream), ("text_completion", None)):
        new_choice = (lambda i: ChatChoiceStream(i, 0, False)) if choice else CompletionChoiceStream
        generation = FakeGeneration(params, three_choices_finishing_apart())
        chunks = sse_chunks(stream_response(generation, kind, new_choice, True, False))
        finishes = [(c["index"], c["finish_reason"]) for chunk in chunks for c in chunk["choices"]]
        assert sorted(f for f in finishes if f[1]) == [(0, "length"), (1, "length"), (2, "length")]
        assert chunks[-1]["usage"]["completion_tokens"] == 2 + 3 + 4
