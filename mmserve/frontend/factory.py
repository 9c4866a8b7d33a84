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
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessorSettings


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


def default_sampling_params(model_dir: Path, *, open_ended: bool) -> SamplingParams:
    """SamplingParams with the model's generation_config.json defaults and EOS ids applied.

    Where the file sets no max_new_tokens, `open_ended` lets answers run to the context limit
    (the server's convention, as in vLLM's server); otherwise SamplingParams' own max_tokens
    stays (as vLLM's offline LLM)."""
    params = SamplingParams()
    generation_file = model_dir / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    params.update_from_generation_config(generation)
    if open_ended and "max_new_tokens" not in generation:
        params.max_tokens = None
    return params


def build_frontend(
    config: EngineConfig, media: MediaLoader, *, open_ended: bool, special_tokens_in_content: bool = False
) -> Frontend:
    """Read the model folder's tokenizer and preprocessor config and start the preprocess pool
    (`config.multimodal.preprocess_workers` processes; 0 = in this process). Special-token text
    in chat messages is plain text unless `special_tokens_in_content`."""
    model_dir = config.model.path
    tokenizer = Tokenizer(model_dir)
    processor_config = json.loads((model_dir / "preprocessor_config.json").read_text())
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
            special_tokens_in_content,
        )
        default_params = default_sampling_params(model_dir, open_ended=open_ended)
    except BaseException:
        pool.close()
        raise
    return Frontend(tokenizer, pool, inputs, OutputProcessor(tokenizer), default_params)
