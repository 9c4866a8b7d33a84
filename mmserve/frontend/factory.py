"""The request-side pieces both entry points share, built in one place from an EngineConfig:
the tokenizer, the preprocess pool, the input and output processors, and the model's default
sampling params. The offline `LLM` and the API server differ only in the media they may load
and in what an unset max_tokens means (see `default_sampling_params`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mmserve.config import EngineConfig
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.output_processor import OutputProcessor
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.frontend.video_inputs import VideoSupport, parse_sampling
from mmserve.models.family import MultiModalProcessor
from mmserve.models.registry import family_named
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool


@dataclass
class Frontend:
    """Owns the preprocess pool (worker processes, shared memory): `close` it when done."""

    tokenizer: Tokenizer
    pool: PreprocessPool
    inputs: InputProcessor
    outputs: OutputProcessor
    default_params: SamplingParams

    def close(self) -> None:
        self.pool.close()


def default_sampling_params(
    model_dir: Path, *, open_ended: bool, eos_token_ids: tuple[int, ...] = ()
) -> SamplingParams:
    """SamplingParams with the model's generation_config.json defaults and EOS ids applied.

    `eos_token_ids` are the model's (ModelConfig's: generation_config.json's, else
    config.json's), so a folder without generation_config.json still stops at EOS.
    Where the file sets no max_new_tokens, `open_ended` lets answers run to the context limit
    (the server's convention, as in vLLM's server); otherwise SamplingParams' own max_tokens
    stays (as vLLM's offline LLM)."""
    params = SamplingParams()
    generation_file = model_dir / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    if generation.get("eos_token_id") is None and eos_token_ids:
        generation = {**generation, "eos_token_id": list(eos_token_ids)}
    params.update_from_generation_config(generation)
    if open_ended and "max_new_tokens" not in generation:
        params.max_tokens = None
    return params


def build_frontend(
    config: EngineConfig,
    media: MediaLoader,
    *,
    open_ended: bool,
    special_tokens_in_content: bool = False,
    chat_template: str | None = None,
) -> Frontend:
    """Read the model folder's tokenizer, build its family's multimodal processor and start the
    preprocess pool with the processor's image transform (`config.multimodal.preprocess_workers`
    processes; 0 = in this process), its cache and the engine's pixel store each bounded by
    `config.multimodal.processor_cache_bytes`. Special-token text in chat messages is plain text
    unless `special_tokens_in_content`. `chat_template` (Jinja source) replaces the folder's;
    `config.multimodal.processor_kwargs` override the processor's settings, and so enter every
    item's hash."""
    model_dir = config.model.path
    tokenizer = Tokenizer(model_dir, chat_template=chat_template)
    family = family_named(config.model.family)
    processor = family.multimodal_processor(config.model, tokenizer, config.multimodal.processor_kwargs)
    pool = PreprocessPool(
        processor.image_settings,
        config.multimodal.preprocess_workers,
        cache_bytes=config.multimodal.processor_cache_bytes,
    )
    try:
        inputs = InputProcessor(
            tokenizer,
            pool,
            media,
            config.model.max_model_len,
            config.multimodal.max_images_per_prompt,
            processor,
            video_support(config, processor),
            special_tokens_in_content=special_tokens_in_content,
            pixel_store_bytes=config.multimodal.processor_cache_bytes,
        )
        default_params = default_sampling_params(
            model_dir, open_ended=open_ended, eos_token_ids=config.model.eos_token_ids
        )
    except BaseException:
        pool.close()
        raise
    return Frontend(tokenizer, pool, inputs, OutputProcessor(tokenizer), default_params)


def video_support(config: EngineConfig, processor: MultiModalProcessor) -> VideoSupport | None:
    """The model's video transform, the server's default sampling and the per-prompt limit
    (None: the family takes no videos)."""
    if processor.video_settings is None:
        return None
    sampling = parse_sampling(config.multimodal.media_io_kwargs.get("video"))
    return VideoSupport(processor.video_settings, config.multimodal.max_videos_per_prompt, sampling)
