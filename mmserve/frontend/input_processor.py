"""Prompts in, EngineRequest-ready token ids and image / video features out.

Chat messages are validated, their images and videos loaded (data URL, file, http) and
preprocessed by the pool, the chat template renders one <|image_pad|> per image and one
<|video_pad|> per video, and each pad is expanded to its item's tokens (see `video_inputs` for
a video's). The item's mm_hash from the pool keys every cache.
"""

from __future__ import annotations

import asyncio
import operator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from mmserve.config import PROCESSOR_KWARGS
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.placeholders import PlaceholderMismatch, expand_placeholders
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.frontend.video_inputs import (
    VideoArgumentError,
    VideoData,
    VideoRef,
    VideoSupport,
    offline_video,
    parse_sampling,
    pool_input,
)
from mmserve.protocol import EngineRequest, MultiModalFeature
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessedImage, VideoSource

ImageInput = bytes | Image.Image
MediaInput = ImageInput | VideoData  # in the prompt's order

ROLES = ("system", "user", "assistant", "tool")


class PromptError(ValueError):
    """The request's prompt or messages are invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    features: list[MultiModalFeature]

    def engine_request(
        self, request_id: str, params: SamplingParams, arrival_time: float, priority: int = 0
    ) -> EngineRequest:
        """The message that hands this prompt to EngineCore (one per sample when n > 1)."""
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=self.token_ids,
            mm_features=self.features,
            sampling_params=params,
            arrival_time=arrival_time,
            priority=priority,
        )


def parse_messages(
    messages: list[dict], loader: MediaLoader, max_images: int | None = None, max_videos: int | None = None
) -> tuple[list[dict], list[MediaInput]]:
    """Validate OpenAI-style messages → (messages for the template, image / video inputs in order).

    Every message is checked, and the image and video counts against their limits, before any
    item is loaded: a request over a limit costs no file read or fetch."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list", "messages")
    template_messages, refs = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise PromptError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_short(role)}", "messages"
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        # A template that renders tools reads these beside the content.
        tool_fields = {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if key in message}
        if isinstance(content, str):
            template_messages.append({"role": role, "content": content, **tool_fields})
            continue
        if not isinstance(content, list):
            raise PromptError(f"messages[{i}].content must be a string or a list of parts", "messages")
        parts = []
        for j, part in enumerate(content):
            parts.append(_parse_part(part, f"messages[{i}].content[{j}]", refs))
        template_messages.append({"role": role, "content": parts, **tool_fields})
    num_videos = sum(isinstance(ref, VideoRef) for ref in refs)
    if max_images is not None and len(refs) - num_videos > max_images:
        raise PromptError(
            f"at most {max_images} images are allowed per prompt, got {len(refs) - num_videos}", "messages"
        )
    if max_videos is not None and num_videos > max_videos:
        raise PromptError(f"at most {max_videos} videos are allowed per prompt, got {num_videos}", "messages")
    return template_messages, [_load(ref, loader) for ref in refs]


def _load(ref: str | Image.Image | VideoRef, loader: MediaLoader) -> MediaInput:
    if isinstance(ref, VideoRef):
        return VideoData(data=loader.load_video(ref.url))
    return loader.load(ref) if isinstance(ref, str) else ref


def _parse_part(part, where: str, refs: list[str | Image.Image | VideoRef]) -> dict:
    """One content part → its template form; an image's URL (or PIL image) or a video's URL
    goes to `refs`."""
    if not isinstance(part, dict):
        raise PromptError(f"{where} must be an object", "messages")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise PromptError(f"{where}.text must be a string", "messages")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise PromptError(f"{where}.image_url.url must be a string", "messages")
        refs.append(url)
        return {"type": "image"}
    if kind == "image" and isinstance(part.get("image"), Image.Image):
        refs.append(part["image"])
        return {"type": "image"}
    if kind == "video_url":
        ref = part.get("video_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise PromptError(f"{where}.video_url.url must be a string", "messages")
        refs.append(VideoRef(url))
        return {"type": "video"}
    raise PromptError(
        f"{where}.type {_short(kind)} is not supported (use 'text', 'image_url' or 'video_url')", "messages"
    )


def _short(value: object, limit: int = 64) -> str:
    """repr of a client value for an error message, cut short: errors never echo megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _videos_of(data: dict) -> list:
    """`multi_modal_data["video"]`: one video (frames, or a (frames, metadata) pair) or a list
    of them; a list of PIL images is one video's frames."""
    videos = data.get("video", [])
    if isinstance(videos, list) and videos and isinstance(videos[0], Image.Image):
        return [videos]
    return _as_list(videos)


def as_pool_input(image: ImageInput) -> bytes | Image.Image:
    if isinstance(image, (bytes, Image.Image)):
        return image
    if isinstance(image, np.ndarray):
        return Image.fromarray(image)
    raise PromptError(f"unsupported image type {type(image).__name__}", "multi_modal_data")


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        pool: PreprocessPool,
        loader: MediaLoader,
        max_model_len: int,
        image_limit: int,
        videos: VideoSupport | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.loader = loader
        self.max_model_len = max_model_len
        self.image_limit = image_limit
        self.videos = videos  # None: the model folder has no video processor; videos are refused
        self.video_limit = videos.limit if videos else 0
        # The longest token's text (byte-level BPE shows one character per byte): a bound on how
        # many characters one token can cover.
        self.max_token_chars = max(1, max(len(tokenizer.id_to_token(i)) for i in range(tokenizer.vocab_size)))

    # Each entry point has a blocking and an asyncio form; they differ only in how images
    # reach the pool. `mm_processor_kwargs` ({"num_frames": N} or {"fps": F}) samples this
    # request's videos instead of the server's default.

    def chat(
        self, messages: list[dict], mm_processor_kwargs: dict | None = None, **template_kwargs
    ) -> ProcessedPrompt:
        template_messages, items = parse_messages(messages, self.loader, self.image_limit, self.video_limit)
        text = self._render(template_messages, items, template_kwargs)
        token_ids = self._encode(text)
        inputs = self._pool_inputs(items, mm_processor_kwargs)
        return self._build(text, token_ids, [self.pool.process(item) for item in inputs])

    async def chat_async(
        self, messages: list[dict], mm_processor_kwargs: dict | None = None, **template_kwargs
    ) -> ProcessedPrompt:
        template_messages, items = await asyncio.to_thread(
            parse_messages, messages, self.loader, self.image_limit, self.video_limit
        )
        text = self._render(template_messages, items, template_kwargs)
        token_ids = self._encode(text)  # (over the context: refused before any image is processed)
        processed = await self._process_all_async(self._pool_inputs(items, mm_processor_kwargs))
        return self._build(text, token_ids, processed)

    def prompt(self, prompt: str | dict) -> ProcessedPrompt:
        text, token_ids, items = self._parse_prompt(prompt)
        return self._build(text, token_ids, [self.pool.process(item) for item in self._pool_inputs(items)])

    async def prompt_async(self, prompt: str | dict) -> ProcessedPrompt:
        text, token_ids, items = self._parse_prompt(prompt)
        self._check_length(len(token_ids))
        processed = await self._process_all_async(self._pool_inputs(items))
        return self._build(text, token_ids, processed)

    def _pool_inputs(
        self, items: list[MediaInput], mm_processor_kwargs: dict | None = None
    ) -> list[bytes | Image.Image | VideoSource]:
        """What the pool is given for each item; videos sampled per the request or the server."""
        if set(mm_processor_kwargs or {}) & set(PROCESSOR_KWARGS):
            raise PromptError(
                "min_pixels and max_pixels are the server's (--mm-processor-kwargs), not a request's",
                "mm_processor_kwargs",
            )
        if not any(isinstance(item, VideoData) for item in items):
            return [as_pool_input(item) for item in items]
        if self.videos is None:
            raise PromptError(
                "this model folder has no video processor: videos are not supported", "messages"
            )
        try:
            sampling = parse_sampling(mm_processor_kwargs, self.videos.default_sampling)
        except VideoArgumentError as e:
            raise PromptError(str(e), "mm_processor_kwargs") from None
        return [
            pool_input(item, self.videos.settings, sampling)
            if isinstance(item, VideoData)
            else as_pool_input(item)
            for item in items
        ]

    async def _process_all_async(self, images: list) -> list[ProcessedImage]:
        results = await asyncio.gather(
            *(self.pool.process_async(im) for im in images), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, ProcessedImage):
                    r.release()
            raise errors[0]
        return list(results)

    def _render(self, messages: list[dict], items: list, template_kwargs: dict) -> str:
        self._check_counts(items)
        template_kwargs = dict(template_kwargs)
        add_generation_prompt = template_kwargs.pop("add_generation_prompt", True)
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except TypeError as e:
            if not template_kwargs:
                raise
            # A client's kwarg shadowed something the template calls (e.g. raise_exception).
            message = f"chat template error with chat_template_kwargs: {e}"
            raise PromptError(message, "chat_template_kwargs") from None

    def _check_counts(self, items: list) -> None:
        num_videos = sum(isinstance(item, VideoData) for item in items)
        for what, count, limit in (
            ("images", len(items) - num_videos, self.image_limit),
            ("videos", num_videos, self.video_limit),
        ):
            if count > limit:
                raise PromptError(f"at most {limit} {what} are allowed per prompt, got {count}", "messages")

    def _parse_prompt(self, prompt: str | dict) -> tuple[str | None, list[int], list]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt), []
        if not isinstance(prompt, dict):
            raise PromptError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'", "prompt")
        data = prompt.get("multi_modal_data") or {}
        items = _as_list(data.get("image", [])) + [self._offline_video(v) for v in _videos_of(data)]
        self._check_counts(items)
        if "prompt_token_ids" in prompt:
            return None, self._check_token_ids(prompt["prompt_token_ids"]), items
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise PromptError("prompt must be a string", "prompt")
        return text, self._encode(text), items

    @staticmethod
    def _offline_video(item) -> VideoData:
        try:
            return offline_video(item)
        except VideoArgumentError as e:
            raise PromptError(str(e), "multi_modal_data") from None

    def _check_token_ids(self, token_ids) -> list[int]:
        """Client token ids, each an int in the vocabulary: an id outside it would fail inside
        the model's embedding, taking down the whole engine step it was batched into."""
        vocab = self.tokenizer.vocab_size
        error = PromptError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        try:
            token_ids = [operator.index(t) for t in token_ids]  # numpy integers are fine
        except TypeError:
            raise error from None
        if any(not 0 <= t < vocab for t in token_ids):
            raise error
        return token_ids

    def _build(
        self, text: str | None, token_ids: list[int], processed: list[ProcessedImage]
    ) -> ProcessedPrompt:
        """Expand each placeholder to its item's tokens; copy pixels out of shared memory."""
        try:
            expanded, features = expand_placeholders(
                token_ids, processed, self.tokenizer.image_pad_id, self.videos.tokens if self.videos else None
            )
        except PlaceholderMismatch as e:
            raise PromptError(str(e), "prompt") from None
        finally:
            for item in processed:
                item.release()
        self._check_length(len(expanded))
        return ProcessedPrompt(text, expanded, features)

    def _encode(self, text: str) -> list[int]:
        """Token ids of `text`, refusing at once a text too long to fit the context whatever its
        tokens: tokenising holds the GIL, and megabytes take seconds during which the event loop
        serves no one (every token covers at most `max_token_chars` characters)."""
        if len(text) > self.max_model_len * self.max_token_chars:
            self._check_length(len(text) // self.max_token_chars, at_least=True)
        token_ids = self.tokenizer.encode(text)
        self._check_length(len(token_ids))
        return token_ids

    def _check_length(self, num_tokens: int, at_least: bool = False) -> None:
        if num_tokens >= self.max_model_len:
            raise PromptError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{'at least ' if at_least else ''}{num_tokens} tokens (at least one more is needed for "
                "the answer)",
                "messages",
            )
