"""The offline API, shaped like vLLM's: `LLM(model=...).generate(...)` / `.chat(...)`.

EngineCore runs in this process; each loop iteration is one engine step.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmserve.engine import build_engine_core
from mmserve.engine_args import EngineArgs
from mmserve.frontend.core_client import InprocCoreClient
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.file_store import FileStore
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.params import prepare_params, truncate_prompt
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.outputs import RequestOutput
from mmserve.protocol import SchedulerStats
from mmserve.sampling_params import SamplingParams


def with_model_defaults(params: SamplingParams, defaults: SamplingParams) -> SamplingParams:
    """The user's params plus the model's EOS ids (the user's explicit values win)."""
    params = params.clone()
    params.eos_token_ids = sorted(set(params.eos_token_ids) | set(defaults.eos_token_ids))
    return params


class LLM:
    def __init__(
        self,
        model: str | Path,
        *,
        preprocess_workers: int | None = 0,
        allowed_local_media_path: str | None = "/",
        **engine_args: Any,
    ) -> None:
        """`engine_args` are `EngineArgs`' fields (the `mmserve serve` flags, with the same
        defaults). Offline, images are preprocessed in this process and any local file may be
        read, unless `preprocess_workers` / `allowed_local_media_path` say otherwise; and the
        engine's threads are not pinned (`cpu_threads_bind="none"`) unless asked: the engine runs
        in the caller's process, whose own threads, and every process it starts later, would
        inherit the pinning."""
        engine_args.setdefault("cpu_threads_bind", "none")
        args = EngineArgs(model=model, preprocess_workers=preprocess_workers, **engine_args)
        self.config = args.create_engine_config()
        self._frontend = build_frontend(self.config, MediaLoader(allowed_local_media_path), open_ended=False)
        self.tokenizer = self._frontend.tokenizer
        self._default_params = self._frontend.default_params
        self._inputs = self._frontend.inputs
        self._outputs = self._frontend.outputs
        try:
            self.engine_core = build_engine_core(self.config)
        except BaseException:
            self._frontend.close()
            raise
        self._client = InprocCoreClient(self.engine_core)
        self._ids = itertools.count()
        self._files = FileStore(tempfile.mkdtemp(prefix="mmserve-files-"), ttl_s=None)

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
        return self._run([self._inputs.prompt(prompt) for prompt in prompts], sampling_params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of OpenAI-style messages) or a list of conversations.
        `mm_processor_kwargs` ({"num_frames": N} or {"fps": F}) samples their videos."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        kwargs = chat_template_kwargs or {}
        files = self._files.resolver("")
        prompts = [
            self._inputs.chat(conversation, mm_processor_kwargs, files, **kwargs)
            for conversation in conversations
        ]
        return self._run(prompts, sampling_params)

    def upload_image(self, data: bytes, filename: str = "image") -> str:
        """Store an encoded image (checked and preprocessed now) for this LLM's lifetime; its id
        works in chat parts as the server's Files API ids do ({"type": "image_file", ...})."""
        mm_hash = self._inputs.media.preprocess_upload(data)
        return self._files.add("", filename, "vision", data, mm_hash).id

    def stats(self) -> SchedulerStats:
        return self.engine_core.scheduler.stats()

    def close(self) -> None:
        """Stop the workers (processes, with tensor parallelism) and the preprocess pool."""
        self.engine_core.shutdown()
        self._inputs.media.engine_gone()
        self._frontend.close()
        shutil.rmtree(self._files.directory, ignore_errors=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _run(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        """Submit every prompt, then step the engine until all have finished; outputs in order."""
        try:
            request_ids = [
                self._submit(prompt, params)
                for prompt, params in zip(prompts, self._params_per_prompt(sampling_params, len(prompts)))
            ]
        finally:
            for prompt in prompts:  # (each one submitted is already)
                prompt.release()
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(request_ids):
                self._step(finished)
        finally:
            # Interrupted (an exception, ^C): what is unfinished is aborted, not left in the engine.
            for request_id in request_ids:
                if request_id not in finished:
                    self._client.abort_requests(self._outputs.abort(request_id))
        return [finished[request_id] for request_id in request_ids]

    def _step(self, finished: dict[str, RequestOutput]) -> None:
        """One engine step; finished requests go to `finished`."""
        engine_outputs = self._client.get_output()
        self._inputs.media.apply_engine_outputs(engine_outputs)
        results, to_abort = self._outputs.process_outputs(engine_outputs.outputs)
        if to_abort:
            self._client.abort_requests(to_abort)
        for result in results:  # RequestOutputKind.FINAL_ONLY: each is a finished request
            finished[result.request_id] = result

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self._default_params] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            raise ValueError(f"{len(params_list)} sampling params for {num_prompts} prompts")
        return params_list

    def _submit(self, prompt: ProcessedPrompt, params: SamplingParams) -> str:
        """Hand one prompt to the engine (n > 1 fans out into n engine requests); its request id."""
        request_id = str(next(self._ids))
        try:
            params = prepare_params(with_model_defaults(params, self._default_params), self.tokenizer)
            prompt = truncate_prompt(prompt, params.truncate_prompt_tokens)
            for engine_id, child in self._outputs.add_request(
                request_id, prompt.prompt, prompt.token_ids, params
            ):  # n > 1: the first brings the pixels, the others go by hash
                request = self._inputs.media.engine_request(prompt, engine_id, child, time.monotonic())
                self._client.add_request(request)  # applies its store changes, reads its handles
        finally:
            prompt.release()
        return request_id
