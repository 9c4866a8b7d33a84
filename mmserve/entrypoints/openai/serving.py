"""Chat and text completions: from a validated request to a JSON body or an SSE stream.

Both build a `Generation` (generation.py) and either gather its final outputs or stream its
deltas through the one stream builder (streaming.py). Chat adds tools (tools.py,
chat_messages.py); completions add best_of.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncIterator

from mmserve.entrypoints.openai.chat_messages import prepare_messages
from mmserve.entrypoints.openai.errors import bad_request
from mmserve.entrypoints.openai.generation import (
    Generation,
    admit,
    check_request,
    chunk_base,
    prepare,
)
from mmserve.entrypoints.openai.limits import check_answer_size, check_prompt_logprobs_size
from mmserve.entrypoints.openai.logprobs_format import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
)
from mmserve.entrypoints.openai.responses import answer_bytes
from mmserve.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest, FieldError
from mmserve.entrypoints.openai.state import AppState
from mmserve.entrypoints.openai.streaming import ChatChoiceStream, CompletionChoiceStream, stream_response
from mmserve.entrypoints.openai.tools import check_tools, parse_tool_calls, tool_call_grammar
from mmserve.frontend.async_llm import Reservation
from mmserve.frontend.file_store import FileResolver
from mmserve.frontend.params import prepare_params, truncate_prompt
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SamplingParams, StructuredOutputsParams, TokenIdError

logger = logging.getLogger("mmserve.api")


async def _engine_params(state: AppState, params: SamplingParams, stream: bool) -> SamplingParams:
    """The request's params checked against the vocabulary and grammars (off the event loop)."""
    if stream and params.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs cannot be streamed", "prompt_logprobs")
    try:
        return await asyncio.to_thread(prepare_params, params, state.frontend.tokenizer)
    except TokenIdError as e:
        raise bad_request(str(e), e.field) from None
    except ValueError as e:
        param = "structured_outputs" if str(e).startswith("invalid structured_outputs") else None
        raise bad_request(str(e), param) from None


def _truncated(prompt: ProcessedPrompt, params: SamplingParams, reservation: Reservation) -> ProcessedPrompt:
    try:
        return truncate_prompt(prompt, params.truncate_prompt_tokens)
    except ValueError as e:
        reservation.release()
        raise bad_request(str(e), "truncate_prompt_tokens") from None


def _check_prompt_logprobs(
    params: SamplingParams, prompts: list[ProcessedPrompt], copies: int, reservation: Reservation
) -> None:
    """The prompt log-probabilities' share of the answer, now that the prompts' lengths are
    known (`copies`: how many times the answer repeats each prompt's list)."""
    try:
        check_prompt_logprobs_size(params, [len(prompt.token_ids) for prompt in prompts], copies)
    except Exception:
        reservation.release()
        raise


def _invalid(error: ValueError, request: ChatCompletionRequest | CompletionRequest):
    """The 400 for a ValueError from building the request's params: SamplingParams' messages
    start with the field they are about, which becomes the error's `param`."""
    if isinstance(error, FieldError):
        return bad_request(str(error), error.field)
    match = re.match(r"[a-z_]+", str(error))
    name = match.group(0) if match else None
    return bad_request(str(error), name if name in type(request).model_fields else None)


def _log_user(request: ChatCompletionRequest | CompletionRequest) -> None:
    user = request.user or getattr(request, "safety_identifier", None)
    if user:
        logger.info("request for user %r", user)


# ------------------------------------------------------------------------------- chat


async def build_chat(
    state: AppState, request: ChatCompletionRequest, files: FileResolver | None = None
) -> Generation:
    """`files` resolves the messages' file ids as the caller (None: file parts are refused)."""
    check_request(state, request.model, request.priority)
    _log_user(request)
    try:
        params = request.sampling_params(state.frontend.default_params)
        tools, parse_tools = _apply_tools(request, params)
        knows_tools = state.frontend.tokenizer.chat_template_mentions("tools")
        messages = prepare_messages(request.messages, tools, knows_tools)
    except ValueError as e:
        raise _invalid(e, request) from None
    check_answer_size(params, 1, state.engine.config.model.max_model_len)
    params = await _engine_params(state, params, request.stream)
    template_kwargs = dict(request.chat_template_kwargs or {})
    for reserved in ("messages", "mm_processor_kwargs", "files"):  # the input processor's own
        if reserved in template_kwargs:
            raise bad_request(f"chat_template_kwargs must not set {reserved!r}", "chat_template_kwargs")
    template_kwargs.setdefault("add_generation_prompt", request.add_generation_prompt)
    if tools and knows_tools:
        template_kwargs["tools"] = tools
    reservation = admit(state, 1)
    chat = state.frontend.inputs.chat_async(messages, request.mm_processor_kwargs, files, **template_kwargs)
    prompt = await prepare(reservation, chat)
    prompt = _truncated(prompt, params, reservation)
    _check_prompt_logprobs(params, [prompt], 1, reservation)
    generation = Generation(state, [prompt], params, request.priority, reservation)
    generation.parse_tools, generation.parallel_tool_calls = parse_tools, request.parallel_tool_calls
    return generation


def _apply_tools(request: ChatCompletionRequest, params: SamplingParams) -> tuple[list[dict] | None, bool]:
    """(tools to put in the prompt, whether to parse tool calls); a forced choice sets the
    grammar that makes the answer tool calls only."""
    choice = request.effective_tool_choice
    tools = request.tools or []
    try:
        forced = check_tools(tools, choice)
    except ValueError as e:
        raise FieldError("tools" if "tools[" in str(e) else "tool_choice", str(e)) from None
    if choice == "none" or not tools:
        return None, False
    if choice == "required" or forced is not None:
        if params.structured_outputs is not None:
            raise FieldError("tool_choice", "a forced tool_choice cannot be combined with response_format")
        grammar = tool_call_grammar(tools, forced, request.parallel_tool_calls)
        params.structured_outputs = StructuredOutputsParams(structural_tag=grammar)
    # The model may write <tool_call> as its special token: keep special tokens in the text.
    params.skip_special_tokens = False
    return tools, True


def _chat_message(completion: CompletionOutput, generation: Generation) -> tuple[dict, str | None]:
    """The choice's message and finish_reason ("tool_calls" when it called tools)."""
    if not generation.parse_tools:
        return {"role": "assistant", "content": completion.text}, completion.finish_reason
    content, calls = parse_tool_calls(completion.text, generation.parallel_tool_calls)
    message = {"role": "assistant", "content": content}
    if not calls:
        return message, completion.finish_reason
    message["tool_calls"] = [call.as_dict() for call in calls]
    return message, "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason


async def chat_response(generation: Generation) -> bytes:
    """The JSON body, built, rendered and freed off the loop (see responses.py)."""
    owned = [await generation.final_outputs()]  # the thread takes the only reference
    return await asyncio.to_thread(answer_bytes, lambda outputs: _chat_body(generation, *outputs), owned)


def _chat_body(generation: Generation, output: RequestOutput) -> dict:
    choices = []
    for completion in output.outputs:
        message, finish_reason = _chat_message(completion, generation)
        choices.append(
            {
                "index": completion.index,
                "message": message,
                "logprobs": chat_logprobs(completion, generation.params.logprobs or 0),
                "finish_reason": finish_reason,
                "stop_reason": completion.stop_reason,
            }
        )
    body = {
        **chunk_base(generation, "chatcmpl", "chat.completion"),
        "choices": choices,
        "usage": generation.usage(),
    }
    if generation.params.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
    return body


def chat_stream(generation: Generation, request: ChatCompletionRequest) -> AsyncIterator[str]:
    top = generation.params.logprobs or 0
    return stream_response(
        generation,
        "chat.completion.chunk",
        lambda index: ChatChoiceStream(index, top, generation.parse_tools, generation.parallel_tool_calls),
        request.include_usage,
        request.continuous_usage,
    )


# ------------------------------------------------------------------------------- completions


async def build_completion(state: AppState, request: CompletionRequest) -> Generation:
    check_request(state, request.model, request.priority)
    _log_user(request)
    try:
        params = request.sampling_params(state.frontend.default_params)
    except ValueError as e:
        raise _invalid(e, request) from None
    try:
        prompts = request.prompts()
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    num_returned = params.n
    if request.best_of is not None and request.best_of > params.n:
        # Sample best_of, return the n most likely: cumulative logprobs are needed for that.
        logprobs = params.logprobs if params.logprobs is not None else 0
        params = dataclasses.replace(params, n=request.best_of, logprobs=logprobs)
    check_answer_size(params, len(prompts), state.engine.config.model.max_model_len)
    params = await _engine_params(state, params, request.stream)
    reservation = admit(state, len(prompts))
    processed = await prepare(reservation, _process_prompts(state, prompts))
    processed = [_truncated(prompt, params, reservation) for prompt in processed]
    _check_prompt_logprobs(params, processed, num_returned, reservation)
    generation = Generation(state, processed, params, request.priority, reservation)
    generation.num_returned, generation.keep_logprobs = num_returned, request.logprobs is not None
    return generation


async def _process_prompts(state: AppState, prompts: list[str | list[int]]) -> list[ProcessedPrompt]:
    inputs = state.frontend.inputs
    return [
        await inputs.prompt_async(prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt})
        for prompt in prompts
    ]


def _best(completions: list[CompletionOutput], count: int, keep_logprobs: bool) -> list[CompletionOutput]:
    """The `count` completions of highest cumulative logprob (best_of), renumbered."""
    if len(completions) == count:
        return completions
    ranked = sorted(completions, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:count]
    return [
        dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
        for i, c in enumerate(ranked)
    ]


async def completion_response(generation: Generation) -> bytes:
    """The JSON body, built, rendered and freed off the loop (see responses.py)."""
    owned = [await generation.final_outputs()]  # the thread takes the only reference
    return await asyncio.to_thread(answer_bytes, lambda outputs: _completion_body(generation, outputs), owned)


def _completion_body(generation: Generation, outputs: list[RequestOutput]) -> dict:
    choices = []
    for prompt_index, output in enumerate(outputs):
        for completion in _best(output.outputs, generation.num_returned, generation.keep_logprobs):
            choice = {
                "index": prompt_index * generation.num_returned + completion.index,
                "text": completion.text,
                "logprobs": completion_logprobs(completion),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
            if generation.params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
            choices.append(choice)
    return {
        **chunk_base(generation, "cmpl", "text_completion"),
        "choices": choices,
        "usage": generation.usage(),
    }


def completion_stream(generation: Generation, request: CompletionRequest) -> AsyncIterator[str]:
    return stream_response(
        generation, "text_completion", CompletionChoiceStream, request.include_usage, request.continuous_usage
    )
