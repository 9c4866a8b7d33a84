"""How big one request's answer may get, checked before the work is done.

One small request can ask for an enormous answer: n=128 choices × 300 tokens × 21
log-probabilities was a 179-byte request and a 58 MB answer. Every token of every choice is
engine work and every log-probability a JSON object the server builds, so both are bounded:
at most `MAX_CHOICES` choices (prompts × n), and an estimated answer of at most
`MAX_ANSWER_BYTES`. The estimate takes max_tokens, or the whole context when it is unset.
Prompt log-probabilities are checked once the prompts' lengths are known.
"""

from __future__ import annotations

from mmserve.entrypoints.openai.errors import bad_request
from mmserve.sampling_params import SamplingParams

MAX_CHOICES = 1024
MAX_ANSWER_BYTES = 32 << 20
TEXT_BYTES_PER_TOKEN = 4  # a token of text, streamed or in the body
LOGPROB_BYTES = 72  # one {"token", "logprob", "bytes"} object (measured: 58 MB / 806,400)


def check_answer_size(params: SamplingParams, num_prompts: int, max_model_len: int) -> None:
    """400 if the answer `params` ask for, for `num_prompts` prompts, may exceed the bounds."""
    choices = num_prompts * params.n
    if choices > MAX_CHOICES:
        raise bad_request(
            f"{num_prompts} prompts × n={params.n} is {choices} choices; at most {MAX_CHOICES} per request",
            "n",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - 1
    per_token = TEXT_BYTES_PER_TOKEN
    if params.logprobs is not None:
        per_token += LOGPROB_BYTES * (1 + params.logprobs)
    estimate = choices * max_tokens * per_token
    if estimate > MAX_ANSWER_BYTES:
        asked = f"{choices} choices × {max_tokens} tokens"
        if params.logprobs is not None:
            asked += f" × {1 + params.logprobs} log-probabilities"
        raise bad_request(
            f"the answer could reach ~{estimate / 1e6:.0f} MB ({asked}); the limit is "
            f"{MAX_ANSWER_BYTES >> 20} MiB: lower n, max_tokens or the number of log-probabilities",
            "max_tokens",
        )


def check_prompt_logprobs_size(params: SamplingParams, prompt_lengths: list[int], copies: int) -> None:
    """400 if the prompts' log-probabilities (each prompt's list repeated `copies` times in the
    answer: completions give it per choice) would exceed `MAX_ANSWER_BYTES`."""
    if params.prompt_logprobs is None:
        return
    estimate = sum(prompt_lengths) * copies * LOGPROB_BYTES * (1 + params.prompt_logprobs)
    if estimate > MAX_ANSWER_BYTES:
        raise bad_request(
            f"the prompt log-probabilities could reach ~{estimate / 1e6:.0f} MB "
            f"({sum(prompt_lengths)} prompt tokens × {copies} × {1 + params.prompt_logprobs}); the limit "
            f"is {MAX_ANSWER_BYTES >> 20} MiB: lower prompt_logprobs, n or the prompt",
            "prompt_logprobs",
        )
