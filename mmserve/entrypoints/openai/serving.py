"""Chat and text completions: from a validated request to a JSON body or an SSE stream.

Both build a `Generation` (generation.py) and either gather its final outputs or stream deltas.
Streaming follows OpenAI and vLLM: the role-only first chunk goes out once the first token
exists, content deltas follow, then finish_reason; with include_usage a last chunk with empty
choices carries usage; then `data: [DONE]`.

A snapshot's CompletionOutput keeps growing while a stream generator waits at a yield, so each
chunk is built from what is there and counted as sent (`_Sent.advance`) before it is yielded;
counting after the yield would skip what arrived meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from mmserve.entrypoints.openai.errors import bad_request
from mmserve.entrypoints.openai.generation import (
    Generation,
    admit,
    check_request,
    chunk_base,
    client_error,
    prepare,
    sse,
    usage_of,
)
from mmserve.entrypoints.openai.limits import check_answer_size
from mmserve.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest
from mmserve.entrypoints.openai.state import AppState
from mmserve.frontend.input_processor import ProcessedPrompt
from mmserve.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class _Sent:
    """How much of one choice has been streamed."""

    chars: int = 0
    tokens: int = 0
    role: bool = False

    def advance(self, completion: CompletionOutput) -> tuple[str, int]:
        """(text not yet sent, index of the first token not yet sent); all of it counts as sent."""
        text, start = completion.text[self.chars :], self.tokens
        self.chars, self.tokens = len(completion.text), len(completion.token_ids)
        return text, start


# ------------------------------------------------------------------------------- chat


async def build_chat(state: AppState, request: ChatCompletionRequest) -> Generation:
    check_request(state, request.model, request.priority)
    try:
        params = request.sampling_params(state.frontend.default_params)
    except ValueError as e:
        raise bad_request(str(e)) from None
    check_answer_size(params, 1, state.engine.config.model.max_model_len)
    template_kwargs = request.chat_template_kwargs or {}
    if "messages" in template_kwargs:
        raise bad_request("chat_template_kwargs must not set 'messages'", "chat_template_kwargs")
    reservation = admit(state, 1)
    prompt = await prepare(reservation, state.frontend.inputs.chat_async(request.messages, **template_kwargs))
    return Generation(state, [prompt], params, request.priority, reservation)


def chat_logprobs(completion: CompletionOutput, top_k: int, start: int = 0) -> dict | None:
    """OpenAI chat logprobs for tokens[start:]: each sampled token and the top_k alternatives."""
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        top = sorted(
            (logprob for logprob in entry.values() if logprob.rank is not None and logprob.rank <= top_k),
            key=lambda logprob: logprob.rank,
        )
        content.append(
            {
                **_token_logprob(entry[token_id]),
                "top_logprobs": [_token_logprob(alternative) for alternative in top],
            }
        )
    return {"content": content}


def _token_logprob(logprob: Logprob) -> dict:
    token = logprob.decoded_token
    return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode())}


async def chat_response(generation: Generation) -> dict:
    [output] = await generation.final_outputs()
    return await asyncio.to_thread(_chat_body, generation, output)  # megabytes, built off the loop


def _chat_body(generation: Generation, output: RequestOutput) -> dict:
    choices = [
        {
            "index": completion.index,
            "message": {"role": "assistant", "content": completion.text},
            "logprobs": chat_logprobs(completion, generation.params.logprobs or 0),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        for completion in output.outputs
    ]
    return {
        **chunk_base(generation, "chatcmpl", "chat.completion"),
        "choices": choices,
        "usage": usage_of([output]),
    }


async def chat_stream(generation: Generation, include_usage: bool) -> AsyncIterator[str]:
    base = chunk_base(generation, "chatcmpl", "chat.completion.chunk")
    sent = [_Sent() for _ in range(generation.params.n)]
    last: RequestOutput | None = None
    try:
        async for _, snapshot in generation.merged_stream():
            last = snapshot
            if snapshot.error:
                raise bad_request(snapshot.error)
            for completion in snapshot.outputs:
                for choice in _chat_choices(
                    completion, sent[completion.index], generation.params.logprobs or 0
                ):
                    yield sse({**base, "choices": [choice]})
        if include_usage and last is not None:
            yield sse({**base, "choices": [], "usage": usage_of([last])})
    except Exception as e:
        yield sse(client_error(e).body())
    yield sse("[DONE]")


def _chat_choices(completion: CompletionOutput, sent: _Sent, top_k: int) -> Iterator[dict]:
    """The chunks' choices for what is new in `completion`: the role once, then a delta. Lazy,
    so the delta is read after the role chunk's yield (anything added meanwhile goes with it)."""
    index = completion.index
    if not sent.role and (completion.token_ids or completion.finished()):
        sent.role = True
        delta = {"role": "assistant", "content": ""}
        yield {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    text, start = sent.advance(completion)
    new_tokens = len(completion.token_ids) > start
    if not (text or (new_tokens and completion.logprobs is not None) or completion.finished()):
        return
    choice = {
        "index": index,
        "delta": {"content": text} if text else {},
        "logprobs": chat_logprobs(completion, top_k, start) if new_tokens else None,
        "finish_reason": completion.finish_reason if completion.finished() else None,
    }
    if completion.finished():
        choice["stop_reason"] = completion.stop_reason
    yield choice


# ------------------------------------------------------------------------------- completions


async def build_completion(state: AppState, request: CompletionRequest) -> Generation:
    check_request(state, request.model, request.priority)
    try:
        params = request.sampling_params(state.frontend.default_params)
        prompts = request.prompts()
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    check_answer_size(params, len(prompts), state.engine.config.model.max_model_len)
    reservation = admit(state, len(prompts))
    processed = await prepare(reservation, _process_prompts(state, prompts))
    return Generation(state, processed, params, request.priority, reservation)


async def _process_prompts(state: AppState, prompts: list[str | list[int]]) -> list[ProcessedPrompt]:
    inputs = state.frontend.inputs
    return [
        await inputs.prompt_async(prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt})
        for prompt in prompts
    ]


def completion_logprobs(completion: CompletionOutput, start: int = 0) -> dict | None:
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top = [], [], []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        sampled = entry[token_id]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        top.append({logprob.decoded_token: logprob.logprob for logprob in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": []}


async def completion_response(generation: Generation) -> dict:
    outputs = await generation.final_outputs()
    return await asyncio.to_thread(_completion_body, generation, outputs)  # built off the loop


def _completion_body(generation: Generation, outputs: list[RequestOutput]) -> dict:
    choices = [
        {
            "index": prompt_index * generation.params.n + completion.index,
            "text": completion.text,
            "logprobs": completion_logprobs(completion),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        for prompt_index, output in enumerate(outputs)
        for completion in output.outputs
    ]
    return {
        **chunk_base(generation, "cmpl", "text_completion"),
        "choices": choices,
        "usage": usage_of(outputs),
    }


async def completion_stream(generation: Generation, include_usage: bool) -> AsyncIterator[str]:
    base = chunk_base(generation, "cmpl", "text_completion")
    sent: dict[int, _Sent] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for prompt_index, snapshot in generation.merged_stream():
            if snapshot.error:
                raise bad_request(snapshot.error)
            for completion in snapshot.outputs:
                index = prompt_index * generation.params.n + completion.index
                choice = _completion_choice(completion, sent.setdefault(index, _Sent()), index)
                if choice is not None:
                    yield sse({**base, "choices": [choice]})
            if snapshot.finished:
                finals[prompt_index] = snapshot
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage_of(list(finals.values()))})
    except Exception as e:
        yield sse(client_error(e).body())
    yield sse("[DONE]")


def _completion_choice(completion: CompletionOutput, sent: _Sent, index: int) -> dict | None:
    """The chunk's choice for what is new in `completion`, or None if nothing is."""
    text, start = sent.advance(completion)
    if not (text or len(completion.token_ids) > start or completion.finished()):
        return None
    return {
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(completion, start),
        "finish_reason": completion.finish_reason if completion.finished() else None,
    }
