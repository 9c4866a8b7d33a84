"""Chat and text completions: from a validated request to a JSON body or an SSE stream.

Both routes share `_Generation`: build the prompt(s), fan them into the engine, and either
gather the final outputs or stream deltas. Streaming follows OpenAI and vLLM: the role-only
first chunk goes out once the first token exists, content deltas follow, then finish_reason;
with include_usage a last chunk with empty choices carries usage; then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from mmserve.entrypoints.openai.errors import OpenAIError, bad_request
from mmserve.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest
from mmserve.frontend.async_llm import AsyncLLM, Reservation
from mmserve.frontend.core_client import EngineDeadError
from mmserve.frontend.input_processor import InputProcessor, ProcessedPrompt, PromptError
from mmserve.frontend.media import MediaError
from mmserve.frontend.tokenizer import TemplateError, Tokenizer
from mmserve.metrics import ServerMetrics
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SamplingParams
from preprocess import ImageError, PreprocessError


@dataclass
class ServingContext:
    """Everything a route needs, built once at start-up."""

    engine: AsyncLLM
    inputs: InputProcessor
    tokenizer: Tokenizer
    default_params: SamplingParams
    served_model_name: str
    metrics: ServerMetrics


def client_error(e: Exception) -> OpenAIError:
    """Map a frontend exception to the HTTP error a client should see."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, PromptError):
        return bad_request(str(e), e.param)
    if isinstance(e, (MediaError, ImageError)):
        return bad_request(str(e), "messages")
    if isinstance(e, (TemplateError, ValueError)):
        return bad_request(str(e))
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {e}")
    if isinstance(e, PreprocessError):
        return OpenAIError(500, f"image preprocessing failed: {e}")
    return OpenAIError(500, f"internal error: {type(e).__name__}")


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.served_model_name:
        raise OpenAIError(
            404, f"the model {model!r} does not exist; this server serves {ctx.served_model_name!r}", "model"
        )


def admit(ctx: ServingContext, places: int) -> Reservation:
    """Refuse work beyond the configured waiting-queue cap instead of queueing without bound;
    otherwise reserve the request's places until the engine has it.

    EngineCore's count of waiting requests is a step old and misses requests still being built,
    so a burst would slip past it: requests this process has sent or is building beyond what can
    run at once count as waiting too (the reservation keeps them counted in between).
    """
    scheduler = ctx.engine.config.scheduler
    cap = scheduler.max_waiting_requests
    if cap:
        sent_beyond_running = ctx.engine.num_unfinished - scheduler.max_num_seqs
        if max(ctx.engine.latest_stats.num_waiting, sent_beyond_running) >= cap:
            raise OpenAIError(503, f"the server is overloaded ({cap} requests waiting); retry later")
    return ctx.engine.reserve(places)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class _Generation:
    """One client request: one or more prompts (completions may batch), each with n choices."""

    def __init__(
        self,
        ctx: ServingContext,
        prompts: list[ProcessedPrompt],
        params: SamplingParams,
        priority: int,
        reservation: Reservation,
    ):
        self.ctx = ctx
        self.prompts = prompts
        self.reservation = reservation
        self.params = params
        self.priority = priority
        self.id_base = uuid.uuid4().hex
        self.created = int(time.time())
        self.start = time.monotonic()

    def streams(self) -> list[AsyncIterator[RequestOutput]]:
        return [
            self.ctx.engine.generate(
                f"{self.id_base}-{i}", prompt, self.params, self.priority, self.reservation
            )
            for i, prompt in enumerate(self.prompts)
        ]

    async def final_outputs(self) -> list[RequestOutput]:
        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            result = None
            async for result in stream:  # the last snapshot is the final one
                self._observe(result)
            return result

        try:
            outputs = await asyncio.gather(*(last(s) for s in self.streams()))
        finally:
            self.forget()
        for out in outputs:
            if out.error:
                raise bad_request(out.error)
        return outputs

    async def merged_stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, snapshot) from all prompts as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()
        streams = self.streams()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for snapshot in stream:
                    self._observe(snapshot)
                    await queue.put((i, snapshot))
            except BaseException as e:
                await queue.put((i, e))
                raise

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.forget()

    def _observe(self, snapshot: RequestOutput) -> None:
        self.ctx.metrics.observe_request(snapshot, self.start)

    def forget(self) -> None:
        """Give back reserved places never taken and drop per-request metric state of prompts
        that ended unfinished (client gone)."""
        self.reservation.release()
        for i in range(len(self.prompts)):
            self.ctx.metrics.forget(f"{self.id_base}-{i}")


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------- chat


async def build_chat(ctx: ServingContext, request: ChatCompletionRequest) -> _Generation:
    check_model(ctx, request.model)
    try:
        params = request.sampling_params(ctx.default_params)
    except ValueError as e:
        raise bad_request(str(e)) from None
    template_kwargs = request.chat_template_kwargs or {}
    if "messages" in template_kwargs:
        raise bad_request("chat_template_kwargs must not set 'messages'", "chat_template_kwargs")
    reservation = admit(ctx, 1)
    try:
        prompt = await ctx.inputs.chat_async(request.messages, **template_kwargs)
    except BaseException as e:  # a cancelled request gives its place back too
        reservation.release()
        if isinstance(e, Exception):
            raise client_error(e) from None
        raise
    return _Generation(ctx, [prompt], params, request.priority, reservation)


def chat_logprobs(completion: CompletionOutput, top_k: int, start: int = 0) -> dict | None:
    """OpenAI chat logprobs for tokens[start:]: each sampled token and the top_k alternatives."""
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        sampled = entry[token_id]
        top = sorted(
            (lp for lp in entry.values() if lp.rank is not None and lp.rank <= top_k), key=lambda lp: lp.rank
        )
        content.append({**_token_logprob(sampled), "top_logprobs": [_token_logprob(lp) for lp in top]})
    return {"content": content}


def _token_logprob(lp) -> dict:
    return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}


async def chat_response(gen: _Generation) -> dict:
    [out] = await gen.final_outputs()
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c, gen.params.logprobs or 0),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in out.outputs
    ]
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return {
        "id": f"chatcmpl-{gen.id_base}",
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.ctx.served_model_name,
        "choices": choices,
        "usage": usage(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens),
    }


async def chat_stream(gen: _Generation, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": f"chatcmpl-{gen.id_base}", "object": "chat.completion.chunk", "created": gen.created}
    base["model"] = gen.ctx.served_model_name
    sent_chars = [0] * gen.params.n
    sent_tokens = [0] * gen.params.n
    role_sent = [False] * gen.params.n
    last: RequestOutput | None = None
    try:
        async for _, snapshot in gen.merged_stream():
            last = snapshot
            if snapshot.error:
                raise bad_request(snapshot.error)
            for c in snapshot.outputs:
                i = c.index
                if not role_sent[i] and (c.token_ids or c.finished()):
                    role_sent[i] = True
                    yield sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
                # `c` keeps growing while this generator waits at a yield: take what is sent
                # and count it as sent before yielding, or text added meanwhile is skipped.
                delta_text = c.text[sent_chars[i] :]
                new_tokens = len(c.token_ids) > sent_tokens[i]
                send = delta_text or (new_tokens and c.logprobs is not None) or c.finished()
                if send:
                    choice = {
                        "index": i,
                        "delta": {"content": delta_text} if delta_text else {},
                        "logprobs": chat_logprobs(c, gen.params.logprobs or 0, sent_tokens[i])
                        if new_tokens
                        else None,
                        "finish_reason": c.finish_reason if c.finished() else None,
                    }
                    if c.finished():
                        choice["stop_reason"] = c.stop_reason
                sent_chars[i] = len(c.text)
                sent_tokens[i] = len(c.token_ids)
                if send:
                    yield sse({**base, "choices": [choice]})
        if include_usage and last is not None:
            completion_tokens = sum(len(c.token_ids) for c in last.outputs)
            yield sse(
                {
                    **base,
                    "choices": [],
                    "usage": usage(len(last.prompt_token_ids), completion_tokens, last.num_cached_tokens),
                }
            )
    except Exception as e:
        error = client_error(e)
        yield sse(error.body())
    yield sse("[DONE]")


# ------------------------------------------------------------------------------- completions


async def build_completion(ctx: ServingContext, request: CompletionRequest) -> _Generation:
    check_model(ctx, request.model)
    try:
        params = request.sampling_params(ctx.default_params)
        prompts = request.prompts()
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    reservation = admit(ctx, len(prompts))
    try:
        processed = [
            await ctx.inputs.prompt_async(p if isinstance(p, str) else {"prompt_token_ids": p})
            for p in prompts
        ]
    except BaseException as e:  # a cancelled request gives its place back too
        reservation.release()
        if isinstance(e, Exception):
            raise client_error(e) from None
        raise
    return _Generation(ctx, processed, params, request.priority, reservation)


def completion_logprobs(completion: CompletionOutput, start: int = 0) -> dict | None:
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top = [], [], []
    for token_id, entry in zip(completion.token_ids[start:], completion.logprobs[start:]):
        sampled = entry[token_id]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        top.append({lp.decoded_token: lp.logprob for lp in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": []}


async def completion_response(gen: _Generation) -> dict:
    outputs = await gen.final_outputs()
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for p, out in enumerate(outputs):
        prompt_tokens += len(out.prompt_token_ids)
        cached += out.num_cached_tokens
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append(
                {
                    "index": p * gen.params.n + c.index,
                    "text": c.text,
                    "logprobs": completion_logprobs(c),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    return {
        "id": f"cmpl-{gen.id_base}",
        "object": "text_completion",
        "created": gen.created,
        "model": gen.ctx.served_model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }


async def completion_stream(gen: _Generation, include_usage: bool) -> AsyncIterator[str]:
    base = {"id": f"cmpl-{gen.id_base}", "object": "text_completion", "created": gen.created}
    base["model"] = gen.ctx.served_model_name
    n = gen.params.n
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        async for p, snapshot in gen.merged_stream():
            if snapshot.error:
                raise bad_request(snapshot.error)
            for c in snapshot.outputs:
                index = p * n + c.index
                # As in chat_stream: count what is sent as sent before yielding.
                delta = c.text[sent_chars.get(index, 0) :]
                start = sent_tokens.get(index, 0)
                send = delta or len(c.token_ids) > start or c.finished()
                if send:
                    choice = {
                        "index": index,
                        "text": delta,
                        "logprobs": completion_logprobs(c, start),
                        "finish_reason": c.finish_reason if c.finished() else None,
                    }
                sent_chars[index] = len(c.text)
                sent_tokens[index] = len(c.token_ids)
                if send:
                    yield sse({**base, "choices": [choice]})
            if snapshot.finished:
                finals[p] = snapshot
        if include_usage:
            prompt_tokens = sum(len(o.prompt_token_ids) for o in finals.values())
            completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
            cached = sum(o.num_cached_tokens for o in finals.values())
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)})
    except Exception as e:
        yield sse(client_error(e).body())
    yield sse("[DONE]")
