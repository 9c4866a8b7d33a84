"""The EngineCore side of structured outputs: compile, track, mask.

- Grammars compile on a worker thread, never on the engine loop, and are cached by their spec
  (`StructuredOutputsParams.key`): n samples of one request, or many requests with one schema,
  compile once. The tokenizer's vocabulary is read (and xgrammar imported) on that thread too,
  when the first structured request arrives.
- The scheduler asks `is_ready` before it lets a request run, so no request is scheduled before
  its grammar exists.
- Each request has one matcher; it accepts exactly the request's output tokens, in order. The
  matcher is a function of (grammar, output tokens), so `sync` rebuilds it from the tokens if the
  two ever disagree (a request resumed after preemption keeps its tokens and its matcher).
- `fill_bitmask` writes one row per request that samples this step, and only for those: rows
  of unconstrained requests cost nothing.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.sampling_params import StructuredOutputsParams
from mmserve.structured_output.grammars import compile_grammar

logger = logging.getLogger("mmserve.structured_output")

MAX_CACHED_GRAMMARS = 256


@dataclass
class _Tracked:
    grammar: Future
    stop_token_ids: list[int]
    matcher: Any = None  # xgrammar.GrammarMatcher, once the grammar is compiled
    num_accepted: int = 0


class StructuredOutputManager:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int], max_num_workers: int = 1):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size  # the model's: bitmask rows cover every logit
        self.eos_token_ids = list(eos_token_ids)
        self._executor = ThreadPoolExecutor(max_num_workers, thread_name_prefix="mmserve-grammar")
        self._compiler: Future | None = None
        self._grammars: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._requests: dict[str, _Tracked] = {}
        self._bitmask = None  # torch int32 [rows, ceil(vocab / 32)], grown on demand

    @property
    def bitmask_width(self) -> int:
        return -(-self.vocab_size // 32)

    # ------------------------------------------------------------------ compiling

    def add_request(self, request_id: str, spec: StructuredOutputsParams, stop_token_ids: list[int]) -> None:
        """Start (or reuse) the compilation of the request's grammar."""
        self._requests[request_id] = _Tracked(self._grammar(spec), list(stop_token_ids) or self.eos_token_ids)

    def _grammar(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key
        future = self._grammars.get(key)
        if future is not None:
            self._grammars.move_to_end(key)
            return future
        if self._compiler is None:
            self._compiler = self._executor.submit(self._build_compiler)
        future = self._executor.submit(self._compile, spec)
        self._grammars[key] = future
        if len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return future

    def _build_compiler(self):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
        )
        return xgr.GrammarCompiler(info, max_threads=1)

    def _compile(self, spec: StructuredOutputsParams):
        return compile_grammar(self._compiler.result(), spec)

    def is_ready(self, request_id: str) -> bool:
        """The request's grammar has compiled (or failed to): it may be scheduled (or failed)."""
        return self._requests[request_id].grammar.done()

    def start(self, request_id: str) -> str | None:
        """Create the request's matcher once its grammar is ready; an error message if the
        grammar could not be compiled."""
        import xgrammar as xgr

        tracked = self._requests[request_id]
        error = tracked.grammar.exception()
        if error is not None:
            logger.warning("structured outputs of %s failed to compile: %s", request_id, error)
            return f"the structured output grammar failed to compile: {str(error).strip()[:300]}"
        tracked.matcher = xgr.GrammarMatcher(
            tracked.grammar.result(), override_stop_tokens=tracked.stop_token_ids
        )
        tracked.num_accepted = 0
        return None

    # ------------------------------------------------------------------ per step

    def accept_token(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; False if the grammar does not allow the token."""
        tracked = self._requests[request_id]
        if not tracked.matcher.accept_token(token_id):
            return False
        tracked.num_accepted += 1
        return True

    def is_terminated(self, request_id: str) -> bool:
        """The grammar is complete and its stop token accepted: the request must stop."""
        return self._requests[request_id].matcher.is_terminated()

    def sync(self, request_id: str, output_token_ids: list[int]) -> bool:
        """Make the matcher's state that of having accepted exactly `output_token_ids` (rebuilt
        from the tokens if it is not); False if the grammar rejects them."""
        tracked = self._requests[request_id]
        if tracked.num_accepted == len(output_token_ids):
            return True
        tracked.matcher.reset()
        tracked.num_accepted = 0
        return all(self.accept_token(request_id, token) for token in output_token_ids)

    def fill_bitmask(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), ceil(vocab / 32)] int32: bit j of row i set = token 32·k + j allowed
        for request_ids[i] (xgrammar's layout)."""
        import torch

        rows = len(request_ids)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty((max(rows, 8), self.bitmask_width), dtype=torch.int32)
        for row, request_id in enumerate(request_ids):
            self._requests[request_id].matcher.fill_next_token_bitmask(self._bitmask, row)
        return self._bitmask[:rows].numpy().copy()

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
