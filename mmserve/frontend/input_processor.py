"""Prompts in, EngineRequest-ready token ids and image / video features out.

Chat messages are validated, their images and videos loaded (data URL, file, http) and
preprocessed by the pool, the chat template renders one placeholder per image and per video,
and each placeholder is expanded to what the model family's processor lays out for its item
(placeholders.py). The item's mm_hash from the pool keys every cache.

An image the engine already holds (its pixel store, as the mirror lists it: media_processor.py)
is hashed and sent by hash alone, never preprocessed or copied; any other image's pixels stay in
the pool's shared memory until the prompt is sent (`MediaProcessor.engine_request`). Uploaded
files (file_store.py) come in by id, with their hash computed at upload.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Callable

import numpy as np
from PIL import Image

from mmserve.frontend.chat_parsing import ImageInput, MediaInput, PromptError, parse_messages
from mmserve.frontend.file_store import FileResolver, StoredImage
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.media_processor import MediaProcessor, Processed
from mmserve.frontend.pixel_store_mirror import Holds
from mmserve.frontend.placeholders import PlaceholderMismatch, expand_placeholders
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.frontend.video_inputs import (
    VideoArgumentError,
    VideoData,
    VideoSupport,
    offline_video,
    parse_sampling,
    pool_input,
)
from mmserve.models.family import MultiModalProcessor
from preprocess import PreprocessPool, VideoSource


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _videos_of(data: dict) -> list:
    """`multi_modal_data["video"]`: one video (frames, or a (frames, metadata) pair) or a list
    of them; a list of PIL images is one video's frames."""
    videos = data.get("video", [])
    if isinstance(videos, list) and videos and isinstance(videos[0], Image.Image):
        return [videos]
    return _as_list(videos)


def as_pool_input(image: ImageInput) -> bytes | Image.Image | StoredImage:
    if isinstance(image, (bytes, Image.Image, StoredImage)):
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
        processor: MultiModalProcessor,
        videos: VideoSupport | None = None,
        special_tokens_in_content: bool = False,
        pixel_store_bytes: int = 1 << 30,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.loader = loader
        self.max_model_len = max_model_len
        self.image_limit = image_limit
        self.processor = processor  # the model family's: what a placeholder becomes
        self.videos = videos  # None: the model folder has no video processor; videos are refused
        self.video_limit = videos.limit if videos else 0
        # False: special-token text in messages is plain text (see special_text.py).
        self.special_tokens_in_content = special_tokens_in_content
        # images and videos → pixels, or by hash; `pixel_store_bytes` bounds the engine's store
        self.media = MediaProcessor(pool, pixel_store_bytes)
        # The longest token's text (byte-level BPE shows one character per byte): a bound on how
        # many characters one token can cover.
        self.max_token_chars = max(1, max(len(tokenizer.id_to_token(i)) for i in range(tokenizer.vocab_size)))

    # Each entry point has a blocking and an asyncio form; they differ only in how images
    # reach the pool. `mm_processor_kwargs` ({"num_frames": N} or {"fps": F}) samples this
    # request's videos instead of the server's default.

    def chat(
        self,
        messages: list[dict],
        mm_processor_kwargs: dict | None = None,
        files: FileResolver | None = None,
        **template_kwargs,
    ) -> ProcessedPrompt:
        text, token_ids, inputs = self._chat_tokens(messages, mm_processor_kwargs, template_kwargs, files)
        return self._build(text, token_ids, *self.media.process_all(inputs))

    async def chat_async(
        self,
        messages: list[dict],
        mm_processor_kwargs: dict | None = None,
        files: FileResolver | None = None,
        **template_kwargs,
    ) -> ProcessedPrompt:
        """`chat` without blocking the loop: validating, loading images, rendering and
        tokenising run in a thread (their cost grows with the request), then the items are
        awaited from the pool and the prompt is assembled in a thread too."""
        text, token_ids, inputs = await asyncio.to_thread(
            self._chat_tokens, messages, mm_processor_kwargs, template_kwargs, files
        )
        processed = await self.media.process_all_async(inputs)  # (over the context: refused before this)
        return await asyncio.to_thread(self._build, text, token_ids, *processed)

    def _chat_tokens(
        self,
        messages: list[dict],
        mm_processor_kwargs: dict | None,
        template_kwargs: dict,
        files: FileResolver | None = None,
    ) -> tuple[str, list[int], list]:
        """(prompt text, token ids with one pad per item, the pool's inputs) of a conversation."""
        template_messages, items = parse_messages(
            messages, self.loader, self.image_limit, self.video_limit, files
        )
        hidden = None
        if not self.special_tokens_in_content:
            shielded, hidden = self.tokenizer.shield.hide([template_messages, template_kwargs])
            template_messages, template_kwargs = shielded
        text = self._render(template_messages, items, template_kwargs)
        inputs = self._pool_inputs(items, mm_processor_kwargs)
        if hidden is None:
            return text, self._encode(text), inputs
        shield = self.tokenizer.shield
        revealed = shield.reveal(text, hidden)
        return revealed, self._encode(revealed, lambda: shield.encode(text, hidden)), inputs

    def prompt(self, prompt: str | dict) -> ProcessedPrompt:
        text, token_ids, items = self._parse_prompt(prompt)
        return self._build(text, token_ids, *self.media.process_all(self._pool_inputs(items)))

    async def prompt_async(self, prompt: str | dict) -> ProcessedPrompt:
        """`prompt` without blocking the loop (tokenising and assembling run in a thread)."""
        text, token_ids, items = await asyncio.to_thread(self._parse_prompt, prompt)
        self._check_length(len(token_ids))
        processed = await self.media.process_all_async(self._pool_inputs(items))
        return await asyncio.to_thread(self._build, text, token_ids, *processed)

    def _pool_inputs(
        self, items: list[MediaInput], mm_processor_kwargs: dict | None = None
    ) -> list[bytes | Image.Image | VideoSource]:
        """What the pool is given for each item; videos sampled per the request or the server."""
        server_only = sorted(set(mm_processor_kwargs or {}) - {"num_frames", "fps"})
        if server_only:
            raise PromptError(
                f"{' and '.join(server_only)} are the server's settings (--mm-processor-kwargs), not a "
                "request's: a request's mm_processor_kwargs may set a video's num_frames or fps",
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
        self, text: str | None, token_ids: list[int], processed: list[Processed], holds: Holds | None
    ) -> ProcessedPrompt:
        """Expand each placeholder to its item's tokens. An image's pixels stay in shared memory,
        held by the prompt until it is sent (a video's are copied out, and its segment let go)."""
        try:
            expanded, features, arrays = expand_placeholders(token_ids, processed, self.processor)
            self._check_length(len(expanded))
        except BaseException as e:
            for item in processed:
                item.release()
            if holds is not None:
                holds.release()
            if isinstance(e, PlaceholderMismatch):
                raise PromptError(str(e), "prompt") from None
            raise
        return ProcessedPrompt.from_processed(text, expanded, features, arrays, processed, holds)

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
