"""Request bodies of the OpenAI-compatible routes, validated strictly (a string is not a number).

Fields a client leaves out stay unset, so the model's generation_config.json defaults apply
to them; `sampling_params` builds the engine's SamplingParams from what was set.

No field is accepted and dropped: each of OpenAI's fields is honoured or, where this server
cannot do what it asks, refused with a 400 naming it (`UNSUPPORTED`). Fields nobody defined
are accepted, as vLLM does, and logged once per name (`log_unknown_fields`). Nested objects
(stream_options, response_format, structured_outputs) refuse unknown keys.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmserve.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("mmserve.api")

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
_NESTED = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

# Integers cross to EngineCore as msgpack, which holds at most 64 bits: a bigger one must be a
# 400 here, not an OverflowError (a 500) when the request is sent.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_N = 128
"""Most choices one request may ask for (OpenAI's limit): each is a request in the engine."""
MAX_PROMPTS = 1024
"""Most prompts in one text-completion request (each is tokenised and queued separately)."""

# field -> (the values that ask for nothing this server lacks, why other values are refused)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "functions": ((None,), "the deprecated functions field is not supported; use tools"),
    "function_call": ((None,), "the deprecated function_call field is not supported; use tool_choice"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "this model does not reason"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "this server stores no completions"),
    "metadata": ((None,), "metadata is kept only with stored completions, which this server does not keep"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier ('default')"),
    "prompt_cache_key": ((None,), "not supported: prefix caching here is automatic, by content"),
    "prompt_cache_retention": ((None,), "not supported: prefix caching here is automatic, by content"),
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported"),
    "echo": ((None, False), "echo is not supported"),
    "continue_final_message": ((None, False), "continue_final_message is not supported"),
    "spaces_between_special_tokens": ((None,), "not supported: special tokens decode without spaces"),
    "use_beam_search": ((None, False), "beam search is not supported"),
}
_logged_unknown: set[str] = set()


def log_unknown_fields(request: BaseModel) -> None:
    """Log each field name no schema knows, once per process (vLLM accepts them silently)."""
    for name in request.model_extra or {}:
        if name not in _logged_unknown and name not in UNSUPPORTED:
            _logged_unknown.add(name)
            logger.warning("ignoring the unknown request field %r (logged once)", name)


def check_unsupported(request: BaseModel) -> None:
    """ValueError naming the first field that asks for something this server does not do."""
    values = {**(request.model_extra or {}), **request.model_dump(exclude_unset=True)}
    for name, (allowed, reason) in UNSUPPORTED.items():
        if name in values and values[name] not in allowed:
            raise FieldError(name, f"{name}: {reason}")


class FieldError(ValueError):
    """A request's value the server refuses; `field` names it for the 400's `param`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# The shape of one chat message. `messages` is validated by the input processor (it loads the
# images), not by pydantic; this only publishes the shape in the OpenAPI schema.
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {"url": {"type": "string"}, "detail": {"enum": ["auto", "high"]}},
        },
    },
}
_VIDEO_PART = {
    "type": "object",
    "required": ["type", "video_url"],
    "properties": {
        "type": {"const": "video_url"},
        "video_url": {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}},
    },
}
_FILE_ID = {"type": "object", "required": ["file_id"], "properties": {"file_id": {"type": "string"}}}
_FILE_PARTS = [  # an image uploaded to /v1/files, by id (OpenAI's two shapes)
    {"type": "object", "required": ["type", kind], "properties": {"type": {"const": kind}, kind: _FILE_ID}}
    for kind in ("image_file", "file")
]
MESSAGE_JSON_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART, _VIDEO_PART, *_FILE_PARTS]}},
                {"type": "null"},
            ]
        },
        "tool_calls": {"type": "array"},
        "tool_call_id": {"type": "string"},
    },
}
_MESSAGES = Field(min_length=1, json_schema_extra={"items": MESSAGE_JSON_SCHEMA})


class StreamOptions(BaseModel):
    model_config = _NESTED
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk
    include_obfuscation: Literal[False] = False  # chunks are not padded


class JsonSchemaFormat(BaseModel):
    model_config = _NESTED
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # answers always match the schema: strict or not, it is enforced


class ResponseFormat(BaseModel):
    model_config = _NESTED
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise FieldError("response_format", "response_format of type json_schema needs json_schema")
        return StructuredOutputsParams(json=self.json_schema.json_schema or {"type": "object"})


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    model_config = _NESTED
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        fields = self.model_dump(exclude_none=True)
        if "json_schema" in fields:
            fields["json"] = fields.pop("json_schema")
        return StructuredOutputsParams(**fields)


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions, with vLLM's extensions."""

    model_config = _STRICT
    model: str | None = None
    n: Annotated[int, Field(le=MAX_N)] = 1
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: int | None = None  # range-checked by SamplingParams (a uint64 fits msgpack)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: Int64 | None = None
    truncate_prompt_tokens: Int64 | None = None
    structured_outputs: StructuredOutputs | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # identifies the end user in the server's log
    priority: Int64 = 0

    def _sampling_overrides(self) -> dict[str, Any]:
        check_unsupported(self)
        log_unknown_fields(self)
        names = {spec.name for spec in dataclasses.fields(SamplingParams)} - {"structured_outputs"}
        # Declared fields only: an unknown extra named like an internal SamplingParams field
        # (eos_token_ids, detokenize, ...) must not reach the engine.
        sent = self.model_dump(exclude_unset=True, include=set(type(self).model_fields))
        overrides = {name: value for name, value in sent.items() if name in names and value is not None}
        if self.logit_bias is not None:
            overrides["logit_bias"] = _token_keys(self.logit_bias)
        if self.structured_outputs is not None:
            overrides["structured_outputs"] = self.structured_outputs.params()
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options needs stream: true")
        return overrides

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _token_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): bias for token, bias in logit_bias.items()}
    except ValueError:
        raise FieldError("logit_bias", "logit_bias keys must be token ids (integers)") from None


class ChatCompletionRequest(_SamplingFields):
    messages: list[Any] = _MESSAGES
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: {"num_frames": N} or {"fps": F} for videos
    safety_identifier: str | None = None  # like `user`: identifies the end user in the log

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        overrides = self._sampling_overrides()
        if self.max_completion_tokens is not None:
            overrides["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise FieldError(
                "top_logprobs", f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}"
            )
        overrides["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        if self.response_format is not None:
            structured = self.response_format.structured_outputs()
            if structured is not None and self.structured_outputs is not None:
                raise FieldError("response_format", "give response_format or structured_outputs, not both")
            if structured is not None:
                overrides["structured_outputs"] = structured
        return dataclasses.replace(defaults, **overrides)

    @property
    def effective_tool_choice(self) -> str | dict:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Int64 | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        overrides = self._sampling_overrides()
        overrides["logprobs"] = self.logprobs
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise FieldError("best_of", "best_of greater than n cannot be streamed")
        return dataclasses.replace(defaults, **overrides)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) > MAX_PROMPTS and not all(isinstance(item, int) for item in prompt):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        if all(isinstance(item, int) for item in prompt):
            return [list(prompt)]
        return list(prompt)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]
