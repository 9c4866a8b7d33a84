"""What chat and text completions share: admitting a request, mapping frontend errors to HTTP
errors, and `Generation`, one client request fanned into the engine (one or more prompts,
each with n choices) whose outputs are gathered or streamed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import msgspec

from mmserve.entrypoints.openai.errors import OpenAIError, bad_request
from mmserve.entrypoints.openai.state import AppState
from mmserve.frontend.async_llm import Reservation
from mmserve.frontend.errors import (
    EngineDeadError,
    FileNotFound,
    ImageError,
    MediaError,
    PreprocessError,
    PromptError,
    ServerShuttingDown,
    TemplateError,
)
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.outputs import CompletionOutput, RequestOutput
from mmserve.sampling_params import SamplingParams

Result = TypeVar("Result")


def client_error(e: Exception) -> OpenAIError:
    """Map a frontend exception to the HTTP error a client should see."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, FileNotFound):  # a deleted, expired or someone else's file
        return OpenAIError(404, str(e), "messages")
    if isinstance(e, PromptError):
        return bad_request(str(e), e.param)
    if isinstance(e, (MediaError, ImageError)):
        return bad_request(str(e), "messages")
    if isinstance(e, (TemplateError, ValueError)):
        return bad_request(str(e))
    if isinstance(e, ServerShuttingDown):
        return OpenAIError(503, str(e))
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"the engine is not running: {e}")
    if isinstance(e, PreprocessError):
        return OpenAIError(500, f"image or video preprocessing failed: {e}")
    return OpenAIError(500, f"internal error: {type(e).__name__}")


def check_request(state: AppState, model: str | None, priority: int) -> None:
    """The request names this server's model (or none), and sets a priority only where the
    engine schedules by priority: under fcfs it would be silently ignored."""
    names = state.server.served_model_names
    if model is not None and model not in names:
        served = " or ".join(repr(name) for name in names)
        message = f"the model {_short(model)} does not exist; this server serves {served}"
        raise OpenAIError(404, message, "model", "model_not_found")
    if priority != 0 and state.engine.config.scheduler.scheduling_policy != "priority":
        raise bad_request(
            f"priority {priority} needs the priority scheduling policy (--scheduling-policy priority); "
            "this server schedules first come, first served",
            "priority",
        )


def _short(value: str, limit: int = 64) -> str:
    """repr of a client string for an error message, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def admit(state: AppState, places: int) -> Reservation:
    """Refuse work beyond the configured waiting-queue cap instead of queueing without bound;
    otherwise reserve the request's places until the engine has it.

    EngineCore's count of waiting requests is a step old and misses requests still being built,
    so a burst would slip past it: requests this process has sent or is building beyond what can
    run at once count as waiting too (the reservation keeps them counted in between).
    """
    scheduler = state.engine.config.scheduler
    cap = scheduler.max_waiting_requests
    if cap:
        sent_beyond_running = state.engine.num_unfinished - scheduler.max_num_seqs
        if max(state.engine.latest_stats.num_waiting, sent_beyond_running) >= cap:
            raise OpenAIError(503, f"the server is overloaded ({cap} requests waiting); retry later")
    return state.engine.reserve(places)


async def prepare(reservation: Reservation, work: Awaitable[Result]) -> Result:
    """Await the building of a request's prompts; if it fails or is cancelled, give the reserved
    places back (a failure becomes the HTTP error a client should see)."""
    try:
        return await work
    except BaseException as e:
        reservation.release()
        if isinstance(e, Exception):
            raise client_error(e) from None
        raise


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


_JSON = msgspec.json.Encoder()


def sse(data: dict | str) -> str:
    """One server-sent event. The JSON is msgspec's (compact, UTF-8, a non-finite float as
    null): one event per streamed token, where json.dumps measured ~100x slower."""
    return f"data: {data if isinstance(data, str) else _JSON.encode(data).decode()}\n\n"


def chunk_base(generation: Generation, prefix: str, kind: str) -> dict:
    """The fields every streamed chunk (or the response body) of a request carries."""
    return {
        "id": f"{prefix}-{generation.id_base}",
        "object": kind,
        "created": generation.created,
        "model": generation.state.served_model_name,
    }


class Generation:
    """One client request: one or more prompts (completions may batch), each with n choices.

    Its engine requests stream deltas (RequestOutputKind.DELTA); `final_outputs` adds them up.
    Usage is counted from the deltas as they pass, so a stream can report it at any point."""

    def __init__(
        self,
        state: AppState,
        prompts: list[ProcessedPrompt],
        params: SamplingParams,
        priority: int,
        reservation: Reservation,
    ) -> None:
        self.state = state
        self.prompts = prompts
        self.reservation = reservation
        self.params = params
        self.priority = priority
        self.id_base = uuid.uuid4().hex
        self.created = int(time.time())
        self.start = time.monotonic()
        self.num_completion_tokens = 0
        self.parse_tools = False  # chat with tools: <tool_call> blocks become tool_calls
        self.parallel_tool_calls = True  # False: only the first call is returned
        self.num_returned = params.n  # choices per prompt in the answer (fewer than n under best_of)
        self.keep_logprobs = params.logprobs is not None  # False when only best_of asked for them
        self.num_cached_tokens: dict[int, int] = {}  # prompt index → its prefix-cache hit
        self.times: dict[int, dict[str, float]] = {}  # prompt index → its RequestOutput.metrics

    def streams(self) -> list[AsyncIterator[RequestOutput]]:
        return [
            self.state.engine.generate(
                f"{self.id_base}-{index}", prompt, self.params, self.priority, self.reservation
            )
            for index, prompt in enumerate(self.prompts)
        ]

    def timing(self) -> dict[str, float]:
        """The first prompt's token timing as the server measured it (seconds): time to its first
        token and from its first token to its last, so a client can state the decode speed
        without trusting when the network delivered the tokens. Empty until it has finished."""
        times = self.times.get(0, {})
        names = ("time_to_first_token_s", "decode_time_s")
        return {name: times[name] for name in names if name in times}

    def usage(self) -> dict:
        """Usage so far (the final usage once every prompt has finished)."""
        return usage(
            sum(len(prompt.token_ids) for prompt in self.prompts),
            self.num_completion_tokens,
            sum(self.num_cached_tokens.values()),
        )

    async def final_outputs(self) -> list[RequestOutput]:
        """Each prompt's whole answer: its deltas added up (errors raise a 400)."""
        totals: dict[int, RequestOutput] = {}
        async for index, delta in self.merged_stream():
            if index not in totals:
                totals[index] = dataclasses.replace(delta, outputs=[])
            add_delta(totals[index], delta)
        outputs = [totals[index] for index in range(len(self.prompts))]
        for output in outputs:
            if output.error:
                raise bad_request(output.error)
            output.outputs.sort(key=lambda completion: completion.index)
        return outputs

    async def merged_stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta) from all prompts as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for delta in stream:
                    self._observe(index, delta)
                    await queue.put((index, delta))
            except BaseException as e:
                await queue.put((index, e))
                raise

        tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(self.streams())]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.forget()

    def _observe(self, index: int, delta: RequestOutput) -> None:
        self.num_completion_tokens += sum(len(completion.token_ids) for completion in delta.outputs)
        self.num_cached_tokens[index] = delta.num_cached_tokens
        if delta.finished:
            self.times[index] = delta.metrics
        self.state.metrics.observe_request(delta, self.start, self.params.max_tokens)

    def forget(self) -> None:
        """Give back reserved places never taken and drop per-request metric state of prompts
        that ended unfinished (client gone)."""
        self.reservation.release()
        for index in range(len(self.prompts)):
            self.state.metrics.forget(f"{self.id_base}-{index}")


def add_delta(total: RequestOutput, delta: RequestOutput) -> None:
    """Fold a delta (RequestOutputKind.DELTA) into the request's running total, in place."""
    total.finished, total.error = delta.finished, delta.error
    total.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    by_index = {completion.index: completion for completion in total.outputs}
    for piece in delta.outputs:
        completion = by_index.get(piece.index)
        if completion is None:
            completion = CompletionOutput(
                piece.index, "", [], logprobs=[] if piece.logprobs is not None else None
            )
            total.outputs.append(completion)
            by_index[piece.index] = completion
        completion.text += piece.text
        completion.token_ids.extend(piece.token_ids)
        if piece.logprobs is not None and completion.logprobs is not None:
            completion.logprobs.extend(piece.logprobs)
        completion.cumulative_logprob = piece.cumulative_logprob
        if piece.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = piece.finish_reason, piece.stop_reason
