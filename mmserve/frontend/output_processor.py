"""Engine outputs in, RequestOutputs out: incremental detokenising, stop strings, logprobs, n > 1.

A request with n > 1 is fanned out into n engine requests (children) that share the prompt, so
the prefix cache serves the prompt once; their outputs are gathered back into one
RequestOutput. A stop string found in the text finishes the request here and asks the caller
to abort it in the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mmserve.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from mmserve.outputs import CompletionOutput, Logprob, RequestOutput
from mmserve.protocol import EngineCoreOutput, Logprobs
from mmserve.sampling_params import SamplingParams


@dataclass
class _Child:
    engine_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    completion: CompletionOutput
    num_checked_chars: int = 0  # text before this cannot start a stop string


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    arrival_time: float
    num_cached_tokens: int = 0
    error: str | None = None
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(child.completion.finished() for child in self.children)

    def snapshot(self) -> RequestOutput:
        """The request as it stands. Its CompletionOutputs are the live ones (copying every
        token list every step would cost O(length) per token): they keep growing after this
        returns, so a reader takes what it needs from a snapshot before its next await."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[child.completion for child in self.children],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            metrics=self.metrics,
        )


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of n samples is its own engine request with n = 1; a seed is offset per sample so the
    samples differ yet stay reproducible."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
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
        parent = _Parent(request_id, prompt, prompt_token_ids, children, time.monotonic())
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
        """Apply engine outputs → (updated requests' snapshots, engine ids to abort for stop strings).

        A request's snapshot is returned once per call that changed it; finished requests are
        forgotten after their final snapshot.
        """
        updated: dict[str, _Parent] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self._child_of.get(out.request_id)
            if entry is None:
                continue  # finished here already (stop string) or aborted by the caller
            parent, child = entry
            if out.new_token_ids and parent.first_token_time is None:
                parent.first_token_time = now
                parent.metrics["time_to_first_token_s"] = now - parent.arrival_time
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if self._apply(child, out):
                to_abort.append(child.engine_id)
            if out.error:
                parent.error = out.error
            updated[parent.request_id] = parent
            if child.completion.finished():
                del self._child_of[child.engine_id]
        snapshots = []
        for parent in updated.values():
            if parent.finished:
                parent.metrics["e2e_latency_s"] = now - parent.arrival_time
                del self._parents[parent.request_id]
            snapshots.append(parent.snapshot())
        return snapshots, to_abort

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
            for token in out.new_token_ids:
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
        for ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.sampled_ranks):
            entry = {}
            for position, (token_id, value) in enumerate(zip(ids[: num_top + 1], values[: num_top + 1])):
                token_rank = rank if position == 0 else position
                if token_id not in entry:
                    entry[token_id] = Logprob(value, token_rank, self.tokenizer.decode([token_id], False))
            completion.logprobs.append(entry)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + values[0]


def _empty(index: int, params: SamplingParams) -> CompletionOutput:
    return CompletionOutput(
        index=index, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None
    )
