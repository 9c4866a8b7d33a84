"""Engine outputs in, RequestOutputs out: incremental detokenising, stop strings, logprobs, n > 1.

A request with n > 1 is fanned out into n engine requests (children) that share the prompt, so
the prefix cache serves the prompt once; their outputs are gathered back into one
RequestOutput. A stop string found in the text finishes the request here and asks the caller
to abort it in the engine.

What a request gets is chosen per request (`RequestOutputKind`): deltas (streams) or the final
answer only. A delta never holds text that a stop string could still begin in: such a tail
waits until more text rules the stop string out, or the request finishes (see `_Child`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mmserve.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from mmserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, RequestOutputKind
from mmserve.protocol import EngineCoreOutput, Logprobs
from mmserve.sampling_params import SamplingParams


def held_back_chars(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper beginning of some stop string:
    those characters may still turn into a stop string, so they must not be sent yet."""
    held = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return held


@dataclass
class _Child:
    """One sample of a request: its whole answer so far and how much of it was handed out."""

    engine_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    completion: CompletionOutput
    num_checked_chars: int = 0  # text before this cannot start a stop string
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_sent: bool = False

    def take_delta(self) -> CompletionOutput | None:
        """What is new since the last delta, or None if nothing is. Text that may begin a stop
        string is kept back while the child runs; finish_reason comes exactly once."""
        completion = self.completion
        finished = completion.finished()
        end = len(completion.text)
        if not finished and self.params.stop:
            end -= held_back_chars(completion.text[self.num_sent_chars :], self.params.stop)
        text = completion.text[self.num_sent_chars : end]
        token_ids = completion.token_ids[self.num_sent_tokens :]
        finishes = finished and not self.finish_sent
        if not (text or token_ids or finishes):
            return None
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[self.num_sent_tokens :]
        self.num_sent_chars = max(self.num_sent_chars, end)
        self.num_sent_tokens = len(completion.token_ids)
        self.finish_sent = finished
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=completion.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=completion.finish_reason if finishes else None,
            stop_reason=completion.stop_reason if finishes else None,
        )


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    arrival_time: float
    kind: RequestOutputKind
    num_cached_tokens: int = 0
    error: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float = 0.0  # EngineCore's clock, which is this process's (monotonic)
    # seconds: time_to_first_token_s, e2e_latency_s, and vLLM's queue / prefill / decode /
    # inference times once the engine has reported its first scheduling
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(child.completion.finished() for child in self.children)

    def output(self) -> RequestOutput | None:
        """This call's RequestOutput for the request, by its kind; None if it gets none now."""
        if self.kind is RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            completions = [child.completion for child in self.children]
            return self._output(completions, self.prompt_logprobs)
        deltas = [delta for child in self.children if (delta := child.take_delta()) is not None]
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        if not deltas and not self.finished and prompt_logprobs is None and self.error is None:
            return None
        return self._output(deltas, prompt_logprobs)

    def _output(self, completions: list[CompletionOutput], prompt_logprobs) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            prompt_logprobs=prompt_logprobs,
            metrics=self.metrics,
        )


def _record_times(parent: _Parent, out: EngineCoreOutput, now: float) -> None:
    """Note the request's first scheduling and its first and latest token (see _Parent.metrics)."""
    if out.first_scheduled_time and not parent.first_scheduled_time:
        parent.first_scheduled_time = out.first_scheduled_time
        parent.metrics["queue_time_s"] = max(0.0, out.first_scheduled_time - parent.arrival_time)
    if not out.new_token_ids:
        return
    parent.last_token_time = now
    if parent.first_token_time is None:
        parent.first_token_time = now
        parent.metrics["time_to_first_token_s"] = now - parent.arrival_time
        if parent.first_scheduled_time:
            parent.metrics["prefill_time_s"] = max(0.0, now - parent.first_scheduled_time)


def _record_finish(parent: _Parent, now: float) -> None:
    parent.metrics["e2e_latency_s"] = now - parent.arrival_time
    if parent.first_token_time is not None and parent.last_token_time is not None:
        parent.metrics["decode_time_s"] = parent.last_token_time - parent.first_token_time
        if parent.first_scheduled_time:
            parent.metrics["inference_time_s"] = max(
                0.0, parent.last_token_time - parent.first_scheduled_time
            )


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n samples is its own engine request with n = 1; a seed is offset per sample so the
    samples differ yet stay reproducible. Only the first computes prompt logprobs (they are the
    same for all)."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    if index > 0:
        child.prompt_logprobs = None
    return child


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> list[tuple[str, SamplingParams]]:
        """Track a request; returns the (engine request id, params) of each engine request to send."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = []
        for index in range(params.n):
            engine_id = request_id if params.n == 1 else f"{index}_{request_id}"
            sample_params = child_params(params, index)
            children.append(
                _Child(
                    engine_id,
                    index,
                    sample_params,
                    self.tokenizer.decode_stream(sample_params.skip_special_tokens),
                    _empty(index, sample_params),
                )
            )
        parent = _Parent(request_id, prompt, prompt_token_ids, children, time.monotonic(), kind)
        self._parents[request_id] = parent
        for child in children:
            self._child_of[child.engine_id] = (parent, child)
        return [(child.engine_id, child.params) for child in children]

    def engine_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [child.engine_id for child in parent.children if not child.completion.finished()]

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply engine outputs → (RequestOutputs, engine ids to abort for stop strings).

        A request gets at most one RequestOutput per call (by its kind: a delta when something
        changed, or its final answer once); finished requests are forgotten after their last.
        """
        updated: dict[str, _Parent] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self._child_of.get(out.request_id)
            if entry is None:
                continue  # finished here already (stop string) or aborted by the caller
            parent, child = entry
            _record_times(parent, out, now)
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None:
                self._add_prompt_logprobs(parent, out.new_prompt_logprobs, child.params.prompt_logprobs or 0)
            if self._apply(child, out):
                to_abort.append(child.engine_id)
            if out.error:
                parent.error = out.error
            updated[parent.request_id] = parent
            if child.completion.finished():
                del self._child_of[child.engine_id]
        results = []
        for parent in updated.values():
            if parent.finished:
                _record_finish(parent, now)
                del self._parents[parent.request_id]
            result = parent.output()
            if result is not None:
                results.append(result)
        return results, to_abort

    def abort(self, request_id: str) -> list[str]:
        """Forget a request the caller gave up on; returns the engine ids to abort."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = []
        for child in parent.children:
            if self._child_of.pop(child.engine_id, None) is not None:
                ids.append(child.engine_id)
        return ids

    def _apply(self, child: _Child, out: EngineCoreOutput) -> bool:
        """Fold one engine output into a child; True if a stop string finished it here."""
        completion = child.completion
        completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and completion.logprobs is not None:
            self._add_logprobs(completion, out.new_logprobs, child.params.logprobs or 0)
        if child.params.detokenize:
            for token in _tokens_to_detokenize(child.params, out):
                completion.text += child.detokenizer.step(token)
        if out.finish_reason is not None:
            completion.finish_reason = out.finish_reason
            completion.stop_reason = out.stop_reason
        if child.params.stop and child.params.detokenize:
            stop = self._find_stop_string(child)
            if stop is not None:
                completion.finish_reason, completion.stop_reason = "stop", stop
                return out.finish_reason is None  # the engine still runs it
        return False

    @staticmethod
    def _find_stop_string(child: _Child) -> str | None:
        """Earliest stop string in the text not yet checked; truncates the text at it."""
        completion = child.completion
        longest = max(len(s) for s in child.params.stop)
        start = max(child.num_checked_chars - longest + 1, 0)
        best: tuple[int, str] | None = None
        for stop in child.params.stop:
            position = completion.text.find(stop, start)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        child.num_checked_chars = len(completion.text)
        if best is None:
            return None
        position, stop = best
        end = position + len(stop) if child.params.include_stop_str_in_output else position
        completion.text = completion.text[:end]
        return stop

    def _add_logprobs(self, completion: CompletionOutput, logprobs: Logprobs, num_top: int) -> None:
        for entry, sampled in self._logprob_entries(logprobs, num_top):
            completion.logprobs.append(entry)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sampled

    def _add_prompt_logprobs(self, parent: _Parent, logprobs: Logprobs, num_top: int) -> None:
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]  # the first prompt token has no context to score it
        parent.prompt_logprobs.extend(entry for entry, _ in self._logprob_entries(logprobs, num_top))

    def _logprob_entries(self, logprobs: Logprobs, num_top: int):
        """(entry, logprob of the scored token) per position: the scored token and the top
        `num_top` tokens, each with its rank and text."""
        for ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.sampled_ranks):
            entry = {}
            for position, (token_id, value) in enumerate(zip(ids[: num_top + 1], values[: num_top + 1])):
                token_rank = rank if position == 0 else position
                if token_id not in entry:
                    entry[token_id] = Logprob(value, token_rank, self.tokenizer.decode([token_id], False))
            yield entry, values[0]


def _tokens_to_detokenize(params: SamplingParams, out: EngineCoreOutput) -> list[int]:
    """The new tokens whose text joins the answer: all but a stop token that ended the request
    (EOS or one of stop_token_ids), unless include_stop_str_in_output (as vLLM)."""
    if out.finish_reason == "stop" and out.new_token_ids and not params.include_stop_str_in_output:
        return out.new_token_ids[:-1]
    return out.new_token_ids


def _empty(index: int, params: SamplingParams) -> CompletionOutput:
    return CompletionOutput(
        index=index, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None
    )
