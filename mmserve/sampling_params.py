"""SamplingParams: how one request is sampled and when it stops (vLLM-compatible names).

A leaf module: it imports nothing from mmserve. SamplingParams crosses the ZeroMQ boundary
between the API server and EngineCore, so every field has a builtin type and the class
round-trips through `msgspec.msgpack` (msgspec calls `__post_init__` on decode, so a decoded
value is validated and normalised exactly like a constructed one).
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

MAX_LOGPROBS = 20
"""The most top logprobs (per sampled or prompt token) a request may ask for."""

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (argmax), as in vLLM."""

# The fields a model's generation_config.json may supply defaults for, keyed by its names.
_GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings; validated on construction.

    After `__post_init__`: `stop` and `stop_token_ids` are lists (possibly empty) and `top_k` is
    0 when disabled (-1 is accepted as vLLM's spelling of "disabled").
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context limit
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per sampled token; 0 = the sampled token's only
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    # EOS ids from the model's generation config (set by `update_from_generation_config`, not by
    # users). Kept apart from `stop_token_ids` so that `ignore_eos` can switch them off alone.
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.eos_token_ids = list(self.eos_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be non-negative and finite, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, minimum=0, hint="0 or -1 to disable")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be positive and finite, got {self.repetition_penalty}."
            )
        if self.seed is not None:
            # The range a torch.Generator seed accepts.
            _check_int("seed", self.seed, minimum=-(2**63), maximum=2**64 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1, hint="or None")
        hint = "" if self.max_tokens is None else "at most max_tokens"
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=self.max_tokens, hint=hint)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0, maximum=MAX_LOGPROBS)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, minimum=1)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}.")
        for name in ("stop_token_ids", "eos_token_ids"):
            for token_id in getattr(self, name):
                _check_int(name, token_id, minimum=0, hint="token ids")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Every token id that ends the request (and that `min_tokens` forbids until then)."""
        eos = () if self.ignore_eos else self.eos_token_ids
        return frozenset(self.stop_token_ids).union(eos)

    def clone(self) -> SamplingParams:
        """A deep copy: the clone's lists are its own."""
        return copy.deepcopy(self)

    def update_from_generation_config(self, generation_config: Mapping[str, Any]) -> None:
        """Apply a model's generation_config.json defaults in place (normalised and validated
        like constructor arguments; on a ValueError `self` is unchanged).

        `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens`
        (as `max_tokens`) replace only fields that still hold SamplingParams' own default: a
        field equal to its default counts as "not set by the user", since a dataclass cannot
        tell `temperature=1.0` from no argument. A caller that knows exactly which fields the
        client sent (the OpenAI layer) gets exact precedence with
        `p = SamplingParams(); p.update_from_generation_config(cfg);
        p = dataclasses.replace(p, **client_fields)`.
        `eos_token_id` (an int or a list) is added to `eos_token_ids`. `do_sample` is ignored,
        as in vLLM.
        """
        defaults = {f.name: f.default for f in fields(self)}
        updates: dict[str, Any] = {
            name: generation_config[key]
            for key, name in _GENERATION_CONFIG_KEYS.items()
            if generation_config.get(key) is not None and getattr(self, name) == defaults[name]
        }
        eos = generation_config.get("eos_token_id")
        if eos is not None:
            eos_ids = [eos] if isinstance(eos, int) else list(eos)
            updates["eos_token_ids"] = self.eos_token_ids + [
                t for t in eos_ids if t not in self.eos_token_ids
            ]
        self.__dict__.update(vars(replace(self, **updates)))


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None, hint: str = "") -> None:
    """Raise ValueError naming `name` unless `value` is an int (not a bool) in [minimum, maximum]."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bounds = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        extra = f" ({hint})" if hint else ""
        raise ValueError(f"{name} must be an integer {bounds}{extra}, got {value!r}.")
