"""What `LLM.generate` / `LLM.chat` return, shaped like vLLM's RequestOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (as vLLM's `output_kind`).

    DELTA: only what is new since the request's previous output: the choices that changed,
    each with its new text, token ids and logprobs, and its finish_reason exactly once (in the
    delta that finishes it). Text that might be the start of a stop string is held back until
    it cannot be, so the deltas' texts add up to the final text. FINAL_ONLY: one output, when
    every choice has finished, holding the whole answer.
    """

    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one dict per generated token
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token; None for the first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the engine rejected or failed the request
    # With SamplingParams.prompt_logprobs: in the first output of the request (and the final one)
    prompt_logprobs: PromptLogprobs | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # arrival/first-token/finish times
