"""Prompts in, EngineRequest-ready token ids and image features out.

Chat messages are validated, their images loaded (data URL, file, http) and preprocessed by the
pool, the chat template renders one <|image_pad|> per image, and each pad is expanded to the
image's token count. The image's mm_hash from the pool keys every cache.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from mmserve.frontend.media import MediaLoader, RawDataUrl
from mmserve.frontend.tokenizer import IMAGE_PAD, Tokenizer
from mmserve.protocol import EngineRequest, MultiModalFeature
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessedImage

ImageInput = bytes | Image.Image

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
    messages: list[dict], loader: MediaLoader, max_images: int | None = None
) -> tuple[list[dict], list[ImageInput]]:
    """Validate OpenAI-style messages → (messages for the template, image inputs in order).

    Every message is checked, and the image count against `max_images`, before any image is
    loaded: a request over the limit costs no file read or fetch."""
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
        if isinstance(content, str):
            template_messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise PromptError(f"messages[{i}].content must be a string or a list of parts", "messages")
        parts = []
        for j, part in enumerate(content):
            parts.append(_parse_part(part, f"messages[{i}].content[{j}]", refs))
        template_messages.append({"role": role, "content": parts})
    if max_images is not None and len(refs) > max_images:
        raise PromptError(f"at most {max_images} images are allowed per prompt, got {len(refs)}", "messages")
    images = [loader.load(ref) if isinstance(ref, str | RawDataUrl) else ref for ref in refs]
    return template_messages, images


def _parse_part(part, where: str, refs: list[str | RawDataUrl | Image.Image]) -> dict:
    """One content part → its template form; an image's URL (or PIL image) goes to `refs`."""
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
        if not isinstance(url, str | RawDataUrl):
            raise PromptError(f"{where}.image_url.url must be a string", "messages")
        refs.append(url)
        return {"type": "image"}
    if kind == "image" and isinstance(part.get("image"), Image.Image):
        refs.append(part["image"])
        return {"type": "image"}
    raise PromptError(f"{where}.type {_short(kind)} is not supported (use 'text' or 'image_url')", "messages")


def _short(value: object, limit: int = 64) -> str:
    """repr of a client value for an error message, cut short: errors never echo megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        special_tokens_in_content: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.loader = loader
        self.max_model_len = max_model_len
        self.image_limit = image_limit
        # False: special-token text in messages is plain text (see special_text.py).
        self.special_tokens_in_content = special_tokens_in_content
        # The longest token's text (byte-level BPE shows one character per byte): a bound on how
        # many characters one token can cover.
        self.max_token_chars = max(1, max(len(tokenizer.id_to_token(i)) for i in range(tokenizer.vocab_size)))

    # Each entry point has a blocking and an asyncio form; they differ only in how images
    # reach the pool.

    def chat(self, messages: list[dict], **template_kwargs) -> ProcessedPrompt:
        text, token_ids, images = self._chat_tokens(messages, template_kwargs)
        return self._build(text, token_ids, [self.pool.process(im) for im in images])

    async def chat_async(self, messages: list[dict], **template_kwargs) -> ProcessedPrompt:
        """`chat` without blocking the loop: validating, loading images, rendering and
        tokenising run in a thread (their cost grows with the request), then the images are
        awaited from the pool and the prompt is assembled in a thread too."""
        text, token_ids, images = await asyncio.to_thread(self._chat_tokens, messages, template_kwargs)
        processed = await self._process_all_async(images)  # (over the context: refused before this)
        return await asyncio.to_thread(self._build, text, token_ids, processed)

    def _chat_tokens(self, messages: list[dict], template_kwargs: dict) -> tuple[str, list[int], list]:
        """(prompt text, token ids with one pad per image, image inputs) of a conversation."""
        template_messages, images = parse_messages(messages, self.loader, self.image_limit)
        hidden = None
        if not self.special_tokens_in_content:
            shielded, hidden = self.tokenizer.shield.hide([template_messages, template_kwargs])
            template_messages, template_kwargs = shielded
        text = self._render(template_messages, images, template_kwargs)
        if hidden is None:
            return text, self._encode(text), images
        shield = self.tokenizer.shield
        revealed = shield.reveal(text, hidden)
        return revealed, self._encode(revealed, lambda: shield.encode(text, hidden)), images

    def prompt(self, prompt: str | dict) -> ProcessedPrompt:
        text, token_ids, images = self._parse_prompt(prompt)
        return self._build(text, token_ids, [self.pool.process(as_pool_input(im)) for im in images])

    async def prompt_async(self, prompt: str | dict) -> ProcessedPrompt:
        """`prompt` without blocking the loop (tokenising and assembling run in a thread)."""
        text, token_ids, images = await asyncio.to_thread(self._parse_prompt, prompt)
        self._check_length(len(token_ids))
        processed = await self._process_all_async([as_pool_input(im) for im in images])
        return await asyncio.to_thread(self._build, text, token_ids, processed)

    async def _process_all_async(self, images: list[ImageInput]) -> list[ProcessedImage]:
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

    def _render(self, messages: list[dict], images: list, template_kwargs: dict) -> str:
        self._check_image_count(len(images))
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

    def _check_image_count(self, count: int) -> None:
        if count > self.image_limit:
            raise PromptError(
                f"at most {self.image_limit} images are allowed per prompt, got {count}", "messages"
            )

    def _parse_prompt(self, prompt: str | dict) -> tuple[str | None, list[int], list]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt), []
        if not isinstance(prompt, dict):
            raise PromptError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'", "prompt")
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        images = images if isinstance(images, list) else [images]
        self._check_image_count(len(images))
        if "prompt_token_ids" in prompt:
            return None, self._check_token_ids(prompt["prompt_token_ids"]), images
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise PromptError("prompt must be a string", "prompt")
        return text, self._encode(text), images

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
        """Expand each <|image_pad|> to its image's token count; copy pixels out of shared memory."""
        try:
            pad = self.tokenizer.image_pad_id
            pad_positions = [i for i, t in enumerate(token_ids) if t == pad]
            if len(pad_positions) != len(processed):
                raise PromptError(
                    f"the prompt has {len(pad_positions)} {IMAGE_PAD} placeholders "
                    f"for {len(processed)} images",
                    "prompt",
                )
            expanded: list[int] = []
            features: list[MultiModalFeature] = []
            previous = 0
            for position, image in zip(pad_positions, processed):
                expanded.extend(token_ids[previous:position])
                features.append(
                    MultiModalFeature(
                        image.mm_hash,
                        len(expanded),
                        image.num_tokens,
                        tuple(image.grid_thw),
                        np.array(image.pixel_values),
                    )
                )
                expanded.extend([pad] * image.num_tokens)
                previous = position + 1
            expanded.extend(token_ids[previous:])
        finally:
            for image in processed:
                image.release()
        self._check_length(len(expanded))
        return ProcessedPrompt(text, expanded, features)

    def _encode(self, text: str, tokenize: Callable[[], list[int]] | None = None) -> list[int]:
        """Token ids of `text` (by `tokenize` if given), refusing at once a text too long to
        fit the context whatever its tokens: megabytes take seconds to tokenise (every token
        covers at most `max_token_chars` characters)."""
        if len(text) > self.max_model_len * self.max_token_chars:
            self._check_length(len(text) // self.max_token_chars, at_least=True)
        token_ids = tokenize() if tokenize is not None else self.tokenizer.encode(text)
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
