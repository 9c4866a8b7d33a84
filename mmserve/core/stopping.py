"""What sampled tokens mean for their request: which are taken and whether one stops it
(`append_until_stop`, `check_stop`), which prompt logprobs a step adds
(`unsent_prompt_logprobs`), and the output the frontend is sent (`engine_output`)."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.core.grammar import GrammarGate
from mmserve.core.request import Request, RequestStatus
from mmserve.core.sched_output import LogprobsLists
from mmserve.protocol import EngineCoreOutput, Logprobs


@dataclass
class Appended:
    """The tokens `append_until_stop` took, and the status they finish the request with (None:
    it goes on); `error` says why a grammar rejected the last one."""

    tokens: list[int]
    finish: RequestStatus | None = None
    error: str | None = None


def append_until_stop(
    request: Request, new_tokens: list[int], grammar: GrammarGate, max_model_len: int
) -> Appended:
    """Append `new_tokens` to the request up to and including the first that stops it: one its
    structured-output grammar rejects (an error), a stop condition, or the grammar's end. The
    caller finishes the request with `finish`; tokens after it are dropped."""
    appended = Appended([])
    for token in new_tokens:
        request.append_output_token(token)
        appended.tokens.append(token)
        if not grammar.accept(request, token):
            appended.finish = RequestStatus.FINISHED_ERROR
            appended.error = f"token {token} does not continue the request's structured output grammar"
            return appended
        status = check_stop(request, token, max_model_len)
        if status is None and grammar.is_terminated(request):
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            appended.finish = status
            return appended
    return appended


def engine_output(request: Request, appended: Appended, logprobs: LogprobsLists | None) -> EngineCoreOutput:
    """What the frontend is told about the tokens just appended (after any finish was applied)."""
    return EngineCoreOutput(
        request.request_id,
        appended.tokens,
        finish_reason=request.status.finish_reason,
        error=appended.error,
        stop_reason=request.stop_reason,
        new_logprobs=(
            Logprobs(logprobs.token_ids, logprobs.logprobs, logprobs.sampled_ranks) if logprobs else None
        ),
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.first_scheduled_time,
    )


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished status `token` (just appended) gives the request, if any: a stop token once
    min_tokens are out (recorded as stop_reason if it is one of stop_token_ids), max_tokens, or
    the context limit."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
        if token in params.stop_token_ids:
            request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def unsent_prompt_logprobs(request: Request, computed: tuple[int, LogprobsLists] | None) -> Logprobs | None:
    """The prompt logprobs a step computed (from position `computed[0]` on) that were not sent
    before: a request recomputed after preemption scores its prompt again."""
    if computed is None:
        return None
    start, lists = computed
    skip = request.num_prompt_logprobs_sent - start
    if skip >= len(lists.token_ids):
        return None
    request.num_prompt_logprobs_sent = start + len(lists.token_ids)
    return Logprobs(lists.token_ids[skip:], lists.logprobs[skip:], lists.sampled_ranks[skip:])
