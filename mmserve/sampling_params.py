"""SamplingParams: how one request is sampled and when it stops (vLLM-compatible names).

A leaf module: it imports nothing from mmserve. SamplingParams crosses the ZeroMQ boundary
between the API server and EngineCore, so every field has a builtin type and the class
round-trips through `msgspec.msgpack` (msgspec calls `__post_init__` on decode, so a decoded
value is validated and normalised exactly like a constructed one).
"""

from __future__ import annotations

import copy
import enum
import json
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


MAX_LOGIT_BIAS = 100.0
"""|bias| a logit_bias entry may add (OpenAI's range)."""


class TokenIdError(ValueError):
    """A token id a request carries is outside the vocabulary; `field` names where it is."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar, shaped like vLLM's: exactly one of `json`
    (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object), `regex`,
    `choice` (one of the strings), `grammar` (xgrammar's EBNF) or `structural_tag` (an
    xgrammar structural tag as JSON text; the server builds these for tool calls).

    After `__post_init__` a `json` dict is held as its JSON text (key order kept: it is the
    order the grammar writes the properties in), so the params cross msgpack as plain strings
    and `key` can name a compiled grammar in a cache.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, ensure_ascii=False)
        given = [name for name, value in self._specs().items() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar, "
                f"structural_tag; got {', '.join(given) or 'none'}."
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")

    def _specs(self) -> dict[str, object]:
        return {
            "json": self.json,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "structural_tag": self.structural_tag,
        }

    @property
    def kind(self) -> str:
        """Which spec is set: "json", "json_object", "regex", "choice", "grammar" or "structural_tag"."""
        return next(name for name, value in self._specs().items() if value not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): equal keys compile to the same grammar."""
        value = self._specs()[self.kind]
        if self.kind == "choice":
            return self.kind, json.dumps(value, ensure_ascii=False)
        return self.kind, "" if value is True else str(value)


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
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never generate these words (as token sequences)
    # Token sequences of `bad_words`, set by the frontend (which has the tokenizer): each word
    # alone and after a space, as vLLM encodes them. The engine reads only these.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    # EOS ids from the model's generation config (set by `update_from_generation_config`, not by
    # users). Kept apart from `stop_token_ids` so that `ignore_eos` can switch them off alone.
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.eos_token_ids = list(self.eos_token_ids)
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
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
        self._validate_token_controls()

    def _validate_token_controls(self) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token_id, minimum=0, hint="token ids as keys")
            if not (isinstance(bias, (int, float)) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for {token_id}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty.")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, minimum=0, hint="token ids")
        if any(not isinstance(word, str) or not word for word in self.bad_words or []):
            raise ValueError(f"bad_words must contain only non-empty strings, got {self.bad_words!r}.")
        for ids in self.bad_words_token_ids:
            if not ids:
                raise ValueError("bad_words_token_ids must hold non-empty token sequences.")
            for token_id in ids:
                _check_int("bad_words", token_id, minimum=0, hint="token ids")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise TokenIdError naming the field if any token id here is not below `vocab_size`:
        the engine indexes logits with them, so one out of range must never reach it."""
        fields_ids = {
            "stop_token_ids": self.stop_token_ids,
            "eos_token_ids": self.eos_token_ids,
            "logit_bias": list(self.logit_bias or {}),
            "allowed_token_ids": self.allowed_token_ids or [],
            "bad_words": [t for ids in self.bad_words_token_ids for t in ids],
        }
        for name, ids in fields_ids.items():
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise TokenIdError(
                    name, f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})."
                )

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
