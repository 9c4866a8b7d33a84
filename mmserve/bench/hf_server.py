"""A transformers baseline server: FastAPI around `model.generate`, the API subset the benchmark uses.

    python -m mmserve.bench.hf_server MODEL_DIR --port 8001 [--max-batch-size 8 --batch-wait-ms 50]

Chat completions with text and image_url (data URL) parts, greedy only, streaming with
include_usage; /v1/models and /health. With --max-batch-size 1 (the default) requests run one at
a time. Larger values give static batching: the server waits up to --batch-wait-ms after the first
queued request for more, then runs the whole batch as one left-padded `generate` until every row
is done; requests arriving meanwhile wait for the next batch.

Prompts are built as in `mmserve.testing.reference` (chat template + Qwen2VLImageProcessorPil,
<|image_pad|> expanded to grid_h·grid_w/4 tokens, `mm_token_type_ids` with `image_grid_thw`),
because transformers 5's AutoProcessor needs torchvision, which does not import here.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image
from transformers import StoppingCriteria

from mmserve.testing.reference import PromptInputs, Reference

DEFAULT_MAX_TOKENS = 256


@dataclass
class Job:
    """One request's prompt and limits; tokens arrive on `tokens` (None marks the end)."""

    prompt: PromptInputs
    max_tokens: int
    ignore_eos: bool
    tokens: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    cancelled: threading.Event = field(default_factory=threading.Event)


def parse_messages(messages: list[dict]) -> tuple[list[dict], list[Image.Image]]:
    """OpenAI messages → (template messages with {"type": "image"} parts, images in order)."""
    out, images = [], []
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        parts = []
        for part in content:
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif part["type"] == "image_url":
                url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                if not url.startswith("data:"):
                    raise ValueError("only data: image URLs are supported")
                data = base64.b64decode(url.split(",", 1)[1])
                images.append(Image.open(io.BytesIO(data)).convert("RGB"))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"unsupported content part {part['type']!r}")
        out.append({"role": message["role"], "content": parts})
    return out, images


class _RowStreamer(StoppingCriteria):
    """transformers streamer + stopping criterion for a batch: hands each row's new token to its
    job and reports a row done at its own max_tokens, at EOS (unless ignore_eos) or on cancel."""

    def __init__(self, jobs: list[Job], eos_ids: set[int]) -> None:
        self.jobs, self.eos_ids = jobs, eos_ids
        self.counts = [0] * len(jobs)
        self.done = torch.zeros(len(jobs), dtype=torch.bool)
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._saw_prompt:  # generate() first hands over the prompt ids
            self._saw_prompt = True
            return
        for row, token in enumerate(value.reshape(len(self.jobs), -1)[:, -1].tolist()):
            job = self.jobs[row]
            if self.done[row]:
                continue
            self.counts[row] += 1
            job.loop.call_soon_threadsafe(job.tokens.put_nowait, token)
            hit_eos = token in self.eos_ids and not job.ignore_eos
            if hit_eos or self.counts[row] >= job.max_tokens or job.cancelled.is_set():
                self._finish(row)

    def end(self) -> None:
        for row in range(len(self.jobs)):
            if not self.done[row]:
                self._finish(row)

    def _finish(self, row: int) -> None:
        self.done[row] = True
        job = self.jobs[row]
        job.loop.call_soon_threadsafe(job.tokens.put_nowait, None)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.done.clone()


class HFEngine:
    def __init__(self, model_dir: str, dtype: torch.dtype, max_batch_size: int, batch_wait_s: float) -> None:
        self.ref = Reference(model_dir, dtype)
        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self.pad_id = self.ref.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.ref.tokenizer.eos_token_id
        eos = self.ref.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.queue: asyncio.Queue[Job] = asyncio.Queue()

    async def run_batches(self) -> None:
        """Forever: take a batch from the queue and run it to completion in a worker thread."""
        while True:
            batch = [await self.queue.get()]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(
                        await asyncio.wait_for(self.queue.get(), max(0.0, deadline - time.monotonic()))
                    )
                except asyncio.TimeoutError:
                    break
            batch = [job for job in batch if not job.cancelled.is_set()]
            if batch:
                await asyncio.to_thread(self.generate, batch)

    @torch.inference_mode()
    def generate(self, jobs: list[Job]) -> None:
        streamer = _RowStreamer(jobs, self.eos_ids)
        max_len = max(len(j.prompt.token_ids) for j in jobs)
        ids = torch.full((len(jobs), max_len), self.pad_id, dtype=torch.long)  # ids: [batch, max_len]
        mask = torch.zeros_like(ids)
        for row, job in enumerate(jobs):  # left padding: every prompt ends at the last column
            n = len(job.prompt.token_ids)
            ids[row, max_len - n :] = torch.tensor(job.prompt.token_ids)
            mask[row, max_len - n :] = 1
        kwargs = {}
        pixels = [p for j in jobs for p in j.prompt.pixel_values]
        if pixels:
            kwargs["pixel_values"] = torch.from_numpy(np.concatenate(pixels)).to(self.ref.model.dtype)
            kwargs["image_grid_thw"] = torch.tensor([g for j in jobs for g in j.prompt.grid_thw])
        try:
            self.ref.model.generate(
                input_ids=ids,
                attention_mask=mask,
                mm_token_type_ids=(ids == self.ref.image_token_id).int() * mask,
                max_new_tokens=max(j.max_tokens for j in jobs),
                do_sample=False,
                streamer=streamer,
                stopping_criteria=[streamer],
                eos_token_id=None if any(j.ignore_eos for j in jobs) else sorted(self.eos_ids),
                pad_token_id=self.pad_id,
                **kwargs,
            )
        finally:
            streamer.end()


def build_app(engine: HFEngine, model_name: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher = asyncio.create_task(engine.run_batches())
        yield
        batcher.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "transformers"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        try:
            messages, images = parse_messages(body["messages"])
            prompt = await asyncio.to_thread(engine.ref.build_prompt, messages, images)
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"error": {"message": str(e), "type": "BadRequestError"}}, status_code=400)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        loop = asyncio.get_running_loop()
        job = Job(prompt, int(max_tokens), bool(body.get("ignore_eos")), asyncio.Queue(), loop)
        await engine.queue.put(job)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                _sse(engine, job, rid, model_name, include_usage), media_type="text/event-stream"
            )
        tokens = []
        while (token := await job.tokens.get()) is not None:
            tokens.append(token)
        text = engine.ref.tokenizer.decode(tokens, skip_special_tokens=True)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": _finish_reason(engine, job, tokens),
                }
            ],
            "usage": _usage(job, tokens),
        }

    return app


def _usage(job: Job, tokens: list[int]) -> dict:
    n_in = len(job.prompt.token_ids)
    return {"prompt_tokens": n_in, "completion_tokens": len(tokens), "total_tokens": n_in + len(tokens)}


def _finish_reason(engine: HFEngine, job: Job, tokens: list[int]) -> str:
    return "stop" if tokens and tokens[-1] in engine.eos_ids and not job.ignore_eos else "length"


async def _sse(engine: HFEngine, job: Job, rid: str, model: str, include_usage: bool) -> AsyncIterator[str]:
    """One chunk per generated token (the first also carries the role), then finish, usage, DONE."""
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        return "data: " + json.dumps(event | {"choices": [choice]}) + "\n\n"

    tokens: list[int] = []
    text = ""
    try:
        while (token := await job.tokens.get()) is not None:
            tokens.append(token)
            full = engine.ref.tokenizer.decode(tokens, skip_special_tokens=True)
            delta = {"content": full[len(text) :]} | ({"role": "assistant"} if len(tokens) == 1 else {})
            text = full
            yield chunk(delta)
        yield chunk({}, _finish_reason(engine, job, tokens))
        if include_usage:
            event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            yield "data: " + json.dumps(event | {"choices": [], "usage": _usage(job, tokens)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a client that went away stops its row at the next step


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-batch-size", type=int, default=1, help="1 = one request at a time.")
    parser.add_argument("--batch-wait-ms", type=float, default=50.0, help="How long a batch waits to fill.")
    args = parser.parse_args(argv)
    from pathlib import Path

    engine = HFEngine(args.model, getattr(torch, args.dtype), args.max_batch_size, args.batch_wait_ms / 1000)
    app = build_app(engine, args.served_model_name or Path(args.model).name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
