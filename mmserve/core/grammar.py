"""What the scheduler needs of structured outputs, as an interface: the implementation
(mmserve.structured_output, with xgrammar) is handed in by the engine wiring, so the scheduler
imports no grammar library and stays testable with a fake."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mmserve.core.sched_output import GrammarBitmask

if TYPE_CHECKING:
    import numpy as np

    from mmserve.core.request import Request
    from mmserve.sampling_params import StructuredOutputsParams


class GrammarTracker(Protocol):
    """One grammar matcher per structured request, keyed by request id."""

    def add_request(self, request_id: str, spec: StructuredOutputsParams, stop_token_ids: list[int]) -> None:
        """Start compiling the request's grammar (off the caller's thread)."""

    def is_ready(self, request_id: str) -> bool:
        """Compiled (or failed): the request may leave the compile wait."""

    def start(self, request_id: str) -> str | None:
        """Make the request's matcher; an error message if its grammar failed to compile."""

    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advance the matcher; False if the grammar forbids the token."""

    def is_terminated(self, request_id: str) -> bool:
        """The grammar has ended (its stop token accepted)."""

    def sync(self, request_id: str, output_token_ids: list[int]) -> bool:
        """Bring the matcher to exactly these output tokens; False if the grammar rejects them."""

    def fill_bitmask(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), ceil(vocab / 32)] int32 allowed-token bits, one row per request."""

    def remove(self, request_id: str) -> None:
        """Forget the request."""


class GrammarGate:
    """The scheduler's side of structured outputs. A structured request waits here, outside
    the waiting queue, until its grammar has compiled (the scheduler never schedules one
    before); afterwards its sampled tokens advance its matcher, and each step's bitmask covers
    the structured requests that sample in it."""

    def __init__(self, tracker: GrammarTracker | None) -> None:
        self.tracker = tracker
        self.compiling: list[Request] = []

    @staticmethod
    def is_structured(request: Request) -> bool:
        return request.sampling_params.structured_outputs is not None

    def add(self, request: Request) -> None:
        """Start compiling a structured request's grammar (ValueError if this engine has none)."""
        if self.tracker is None:
            raise ValueError("structured outputs are not available in this engine")
        params = request.sampling_params
        self.tracker.add_request(
            request.request_id, params.structured_outputs, sorted(params.all_stop_token_ids)
        )
        self.compiling.append(request)

    def take_compiled(self) -> list[tuple[Request, str | None]]:
        """The requests whose grammar is ready, with the compile error of those it failed for
        (these stay here until the scheduler fails them; the others leave)."""
        ready, still = [], []
        for request in self.compiling:
            if not self.tracker.is_ready(request.request_id):
                still.append(request)
                continue
            error = self.tracker.start(request.request_id)
            ready.append((request, error))
            if error is not None:
                still.append(request)
        self.compiling = still
        return ready

    def accept(self, request: Request, token_id: int) -> bool:
        """Advance a request's matcher by its newest output token (True for unstructured ones)."""
        return not self.is_structured(request) or self.tracker.accept_token(request.request_id, token_id)

    def is_terminated(self, request: Request) -> bool:
        return self.is_structured(request) and self.tracker.is_terminated(request.request_id)

    def discard(self, request: Request) -> bool:
        """Forget a finished request; True if it was still waiting for its grammar."""
        if self.is_structured(request) and self.tracker is not None:
            self.tracker.remove(request.request_id)
        if request in self.compiling:
            self.compiling.remove(request)
            return True
        return False

    def bitmask(self, sampling: list[Request]) -> GrammarBitmask | None:
        """The allowed-token bits of the structured requests among `sampling` (those that
        sample this step), their matchers first brought to their output tokens."""
        structured = [r for r in sampling if self.is_structured(r)]
        if not structured:
            return None
        for request in structured:
            self.tracker.sync(request.request_id, request.output_token_ids)
        ids = [r.request_id for r in structured]
        return GrammarBitmask(ids, self.tracker.fill_bitmask(ids))
