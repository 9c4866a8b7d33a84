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
from mmserve.frontend.video_inputs import VIDEO_PAD, VideoSupport, VideoTokens, parse_sampling
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessorSettings, VideoSettings


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
    """Read the model folder's tokenizer and preprocessor config and start the preprocess pool
    (`config.multimodal.preprocess_workers` processes; 0 = in this process), its cache and the
    engine's pixel store each bounded by `config.multimodal.processor_cache_bytes`. Special-token text
    in chat messages is plain text unless `special_tokens_in_content`. `chat_template` (Jinja
    source) replaces the folder's; `config.multimodal.processor_kwargs` override the
    preprocessor config's pixel bounds, and so enter every image's hash."""
    model_dir = config.model.path
    tokenizer = Tokenizer(model_dir, chat_template=chat_template)
    processor_config = json.loads((model_dir / "preprocessor_config.json").read_text())
    processor_config |= config.multimodal.processor_kwargs
    pool = PreprocessPool(
        ProcessorSettings.from_hf_config(processor_config, family=config.model.family),
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
            video_support(config, tokenizer),
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


def video_support(config: EngineConfig, tokenizer: Tokenizer) -> VideoSupport:
    """The model's video processor (video_preprocessor_config.json, else preprocessor_config.json
    as transformers falls back), the server's default sampling and the per-prompt limit."""
    model_dir = config.model.path
    video_file = model_dir / "video_preprocessor_config.json"
    if not video_file.is_file():
        video_file = model_dir / "preprocessor_config.json"
    settings = VideoSettings.from_hf_config(json.loads(video_file.read_text()), config.model.family)
    tokens = VideoTokens(
        family=config.model.family,
        pad_id=tokenizer.token_to_id(VIDEO_PAD),
        vision_start_id=config.model.vision_start_token_id,
        vision_end_id=config.model.vision_end_token_id,
        temporal_patch_size=settings.temporal_patch_size,
        encode=tokenizer.encode,
    )
    sampling = parse_sampling(config.multimodal.media_io_kwargs.get("video"))
    return VideoSupport(settings, tokens, config.multimodal.max_videos_per_prompt, sampling)
