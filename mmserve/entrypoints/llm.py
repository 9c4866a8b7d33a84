"""The offline API, shaped like vLLM's: `LLM(model=...).generate(...)` / `.chat(...)`.

EngineCore runs in this process; each loop iteration is one engine step.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path

from mmserve.config import CacheConfig, EngineConfig, ModelConfig, MultiModalConfig, SchedulerConfig
from mmserve.engine import build_engine_core
from mmserve.frontend.core_client import InprocCoreClient
from mmserve.frontend.input_processor import InputProcessor, ProcessedPrompt
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.output_processor import OutputProcessor
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.outputs import RequestOutput
from mmserve.protocol import EngineRequest, SchedulerStats
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessorSettings


def default_sampling_params(model_dir: Path) -> SamplingParams:
    """SamplingParams with the model's generation_config.json defaults and EOS ids applied."""
    params = SamplingParams()
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        params.update_from_generation_config(json.loads(gen_file.read_text()))
    return params


def with_model_defaults(params: SamplingParams, defaults: SamplingParams) -> SamplingParams:
    """The user's params plus the model's EOS ids (the user's explicit values win)."""
    params = params.clone()
    params.eos_token_ids = sorted(set(params.eos_token_ids) | set(defaults.eos_token_ids))
    return params


class LLM:
    def __init__(
        self,
        model: str | Path,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_memory: int = 2 << 30,
        num_kv_blocks: int | None = None,
        long_prefill_token_threshold: int = 0,
        encoder_compute_budget: int = 0,
        encoder_cache_size: int = 0,
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_cache_gb: float = 1.0,
        preprocess_workers: int | None = 0,
        allowed_local_media_path: str | None = "/",
        seed: int = 0,
        device: str | None = None,
    ) -> None:
        model_dir = Path(model)
        model_config = ModelConfig.from_pretrained(model_dir, dtype, max_model_len)
        self.config = EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size, num_kv_blocks, kv_cache_memory, enable_prefix_caching),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=model_config.max_model_len,
                long_prefill_token_threshold=long_prefill_token_threshold,
                encoder_compute_budget=encoder_compute_budget,
                encoder_cache_size=encoder_cache_size,
            ),
            multimodal=MultiModalConfig(
                limit_per_prompt=limit_mm_per_prompt or {"image": 8},
                processor_cache_bytes=int(mm_processor_cache_gb * (1 << 30)),
                preprocess_workers=preprocess_workers,
            ),
            seed=seed,
            device=device,
        )
        self.tokenizer = Tokenizer(model_dir)
        self._default_params = default_sampling_params(model_dir)
        settings = ProcessorSettings.from_hf_config(
            json.loads((model_dir / "preprocessor_config.json").read_text()), family=model_config.family
        )
        self._pool = PreprocessPool(
            settings, preprocess_workers, cache_bytes=self.config.multimodal.processor_cache_bytes
        )
        self._inputs = InputProcessor(
            self.tokenizer,
            self._pool,
            MediaLoader(allowed_local_media_path),
            model_config.max_model_len,
            self.config.multimodal.limit_per_prompt.get("image", 8),
        )
        self._outputs = OutputProcessor(self.tokenizer)
        self.engine_core = build_engine_core(self.config)
        self._client = InprocCoreClient(self.engine_core)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self._default_params.clone()

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """A prompt is a string or {"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._run([self._inputs.prompt(p) for p in prompts], sampling_params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of OpenAI-style messages) or a list of conversations."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        kwargs = chat_template_kwargs or {}
        return self._run([self._inputs.chat(c, **kwargs) for c in conversations], sampling_params)

    def stats(self) -> SchedulerStats:
        return self.engine_core.scheduler.stats()

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _run(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            params_list = [self._default_params] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        order = []
        for prompt, params in zip(prompts, params_list):
            request_id = str(next(self._ids))
            order.append(request_id)
            params = with_model_defaults(params, self._default_params)
            for engine_id, child in self._outputs.add_request(
                request_id, prompt.prompt, prompt.token_ids, params
            ):
                self._client.add_request(
                    EngineRequest(
                        request_id=engine_id,
                        prompt_token_ids=prompt.token_ids,
                        mm_features=prompt.features,
                        sampling_params=child,
                        arrival_time=time.monotonic(),
                    )
                )
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(order):
            engine_outputs = self._client.get_output()
            snapshots, to_abort = self._outputs.process_outputs(engine_outputs.outputs)
            if to_abort:
                self._client.abort_requests(to_abort)
            for snapshot in snapshots:
                if snapshot.finished:
                    finished[snapshot.request_id] = snapshot
        return [finished[request_id] for request_id in order]
