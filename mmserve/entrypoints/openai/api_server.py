"""The API server process: FastAPI routes over AsyncLLM, the preprocess pool, and EngineCore.

Start-up (lifespan) starts the preprocess pool and the EngineCore process; shutdown stops them.
If EngineCore dies, /health turns 503 at once, open requests fail, and the server exits with a
non-zero status so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from mmserve.config import EngineConfig
from mmserve.entrypoints.openai.errors import OpenAIError, bad_request, error_body
from mmserve.entrypoints.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from mmserve.entrypoints.openai.serving import (
    ServingContext,
    build_chat,
    build_completion,
    chat_response,
    chat_stream,
    client_error,
    completion_response,
    completion_stream,
)
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.input_processor import InputProcessor
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.metrics import ServerMetrics
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessorSettings

logger = logging.getLogger("mmserve.api_server")
WEB_DIR = Path(__file__).resolve().parents[2] / "web"


@dataclass
class ServerSettings:
    """What the HTTP layer needs beyond the engine's configuration."""

    engine: EngineConfig
    served_model_name: str
    api_key: str | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] = field(default_factory=list)
    max_body_bytes: int = 64 << 20
    on_engine_dead: object = None  # callable run once if EngineCore dies (the CLI stops uvicorn)


def server_default_params(model_dir: Path) -> SamplingParams:
    """The model's generation_config.json defaults; without max_new_tokens, answers may run to
    the context limit (as in vLLM)."""
    params = SamplingParams()
    gen_file = model_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    params.update_from_generation_config(gen)
    if "max_new_tokens" not in gen:
        params.max_tokens = None
    return params


class BodySizeLimit:
    """ASGI middleware: 413 for a body over the limit, by header or as it streams in.

    A body that outgrows the limit while streaming (no Content-Length, e.g. chunked) is answered
    here, and the app then sees the client as gone: it never gets the rest, and anything it
    would still send is dropped, so exactly one response goes out.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_json(send, 413, self._too_large())
        seen = 0
        started = False  # the app began its response (then it is too late to send a 413)
        rejected = False

        async def limited_receive():
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    rejected = True
                    if not started:
                        await _send_json(send, 413, self._too_large())
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if rejected:
                return
            started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

    def _too_large(self) -> dict:
        return error_body(413, f"request body exceeds {self.max_bytes} bytes")


async def _send_json(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": payload})


def build_app(settings: ServerSettings) -> FastAPI:
    config = settings.engine
    model_dir = config.model.path
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer = Tokenizer(model_dir)
        processor_config = json.loads((model_dir / "preprocessor_config.json").read_text())
        pool = PreprocessPool(
            ProcessorSettings.from_hf_config(processor_config, family=config.model.family),
            config.multimodal.preprocess_workers,
            cache_bytes=config.multimodal.processor_cache_bytes,
        )
        metrics = ServerMetrics(settings.served_model_name)

        def on_outputs(_snapshots, stats) -> None:
            if stats is not None:
                metrics.update_engine(stats)

        def on_dead() -> None:
            state["dead"] = True
            if callable(settings.on_engine_dead):
                settings.on_engine_dead()

        engine = AsyncLLM(config, tokenizer, on_engine_dead=on_dead, on_outputs=on_outputs)
        try:
            await engine.start()
        except Exception:
            pool.close()
            await engine.shutdown()
            raise
        inputs = InputProcessor(
            tokenizer,
            pool,
            MediaLoader(settings.allowed_local_media_path, settings.allowed_media_domains),
            config.model.max_model_len,
            config.multimodal.limit_per_prompt.get("image", 8),
        )
        state["ctx"] = ServingContext(
            engine, inputs, tokenizer, server_default_params(model_dir), settings.served_model_name, metrics
        )
        state["pool"] = pool
        state["created"] = int(time.time())
        logger.info(
            "serving %s as %r; EngineCore pid %d with %d KV blocks; image segments %s*",
            model_dir,
            settings.served_model_name,
            engine.client.process.pid,
            engine.client.num_blocks,
            pool.segment_prefix,
        )
        try:
            yield
        finally:
            # Stop both at once: a supervisor's SIGTERM grace period is short.
            await asyncio.gather(engine.shutdown(), asyncio.to_thread(pool.close))

    app = FastAPI(title="mmserve", lifespan=lifespan)

    def ctx() -> ServingContext:
        return state["ctx"]

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, e: Exception) -> JSONResponse:
        # Starlette still re-raises `e` afterwards, so the traceback reaches the log.
        return OpenAIError(500, f"internal error: {type(e).__name__}").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return bad_request(_describe_validation(e.errors())).response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if settings.api_key and _needs_key(request.url.path):
            header = request.headers.get("authorization", "")
            supplied = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(supplied.encode(), settings.api_key.encode()):
                return OpenAIError(401, "missing or invalid API key").response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if state.get("dead") or "ctx" not in state or ctx().engine.dead:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.served_model_name,
                    "object": "model",
                    "created": state["created"],
                    "owned_by": "mmserve",
                    "root": str(model_dir),
                    "max_model_len": config.model.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = state["pool"].stats()
        ctx().metrics.update_preprocess(stats.cache_queries, stats.cache_hits)
        return Response(ctx().metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        request = await _parse(raw, ChatCompletionRequest)
        gen = await build_chat(ctx(), request)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(chat_stream(gen, include_usage), media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(raw, chat_response(gen)))

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(raw: Request) -> Response:
        request = await _parse(raw, CompletionRequest)
        gen = await build_completion(ctx(), request)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(completion_stream(gen, include_usage), media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(raw, completion_response(gen)))

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize(raw: Request) -> dict:
        request = await _parse(raw, TokenizeRequest)
        c = ctx()
        try:
            if request.messages is not None:
                prompt = await c.inputs.chat_async(request.messages)
            elif request.prompt is not None:
                prompt = await c.inputs.prompt_async(request.prompt)
            else:
                raise bad_request("give either prompt or messages")
        except Exception as e:
            raise client_error(e) from None
        return {
            "tokens": prompt.token_ids,
            "count": len(prompt.token_ids),
            "max_model_len": config.model.max_model_len,
        }

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> dict:
        request = await _parse(raw, DetokenizeRequest)
        vocab = ctx().tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": ctx().tokenizer.decode(request.tokens, skip_special_tokens=False)}

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return BodySizeLimit(app, settings.max_body_bytes)


def _json_body(model) -> dict:
    """The OpenAPI request body of a route that parses its own JSON (see `_parse`): the model's
    JSON schema with its `$defs` inlined, so clients and fuzzers see what is accepted."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def _needs_key(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


async def _parse(raw: Request, model):
    try:
        data = await raw.body()
    except ClientDisconnect:
        raise OpenAIError(499, "client disconnected") from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # also bad UTF-8 and integers over 4300 digits
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(data) and not _is_valid_unicode(body):
        # json.loads keeps a lone surrogate escape as is; no encoder downstream accepts it.
        raise bad_request("the request body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff)")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise bad_request(_describe_validation(e.errors())) from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_valid_unicode(body: dict) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe_validation(errors: list) -> str:
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    return f"invalid value for {where or 'the request'}: {first.get('msg', 'invalid')}"


async def _until_disconnected(raw: Request, coro):
    """Await a response body, but abandon it (aborting its requests) if the client goes away."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            try:
                return work.result()
            except Exception as e:  # e.g. EngineCore died mid-request: 503, not a bare 500
                raise client_error(e) from None
        raise OpenAIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not work.done():  # the client left, or this handler was cancelled (shutdown)
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
