"""Request bodies of the OpenAI-compatible routes, validated strictly (a string is not a number).

Fields a client leaves out stay unset, so the model's generation_config.json defaults apply
to them; `sampling_params` builds the engine's SamplingParams from what was set.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from mmserve.sampling_params import MAX_LOGPROBS, SamplingParams

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

# Integers cross to EngineCore as msgpack, which holds at most 64 bits: a bigger one must be a
# 400 here, not an OverflowError (a 500) when the request is sent.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_N = 128
"""Most choices one request may ask for (OpenAI's limit): each is a request in the engine."""
MAX_PROMPTS = 1024
"""Most prompts in one text-completion request (each is tokenised and queued separately)."""


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
        "image_url": {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}}},
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
MESSAGE_JSON_SCHEMA = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART, _VIDEO_PART]}},
            ]
        },
    },
}
_MESSAGES = Field(min_length=1, json_schema_extra={"items": MESSAGE_JSON_SCHEMA})


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


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
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int64 = 0

    def _sampling_overrides(self) -> dict[str, Any]:
        names = {spec.name for spec in dataclasses.fields(SamplingParams)}
        sent = self.model_dump(exclude_unset=True)
        return {name: value for name, value in sent.items() if name in names and value is not None}


class ChatCompletionRequest(_SamplingFields):
    messages: list[Any] = _MESSAGES
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: {"num_frames": N} or {"fps": F} for videos

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        overrides = self._sampling_overrides()
        if self.max_completion_tokens is not None:
            overrides["max_tokens"] = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}")
        overrides["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return dataclasses.replace(defaults, **overrides)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Int64 | None = None
    echo: bool = False

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        overrides = self._sampling_overrides()
        overrides["logprobs"] = self.logprobs
        if self.echo:
            raise ValueError("echo is not supported")
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
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]
