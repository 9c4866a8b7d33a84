"""What one sampled token means for its request: whether it stops it (`check_stop`), and
which prompt logprobs a step adds (`unsent_prompt_logprobs`)."""

from __future__ import annotations

from mmserve.core.request import Request, RequestStatus
from mmserve.core.sched_output import LogprobsLists
from mmserve.protocol import Logprobs


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
