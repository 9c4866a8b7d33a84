"""The API server process: FastAPI routes over AsyncLLM, the preprocess pool, and EngineCore.

Start-up (lifespan) builds the frontend (tokenizer, preprocess pool, input processor) and starts
the EngineCore process; shutdown stops them. If EngineCore dies, /health turns 503 at once, open
requests fail, and `on_engine_dead` is called (the CLI then exits with a non-zero status, so a
supervisor restarts the server). At SIGTERM the `Drain` gives running requests their grace period.

Middleware, outermost first: the count of requests in flight (for the garbage collector), the
Host check, the Origin check, the body size limit, then inside FastAPI CORS (only with
--allowed-origins) and the API key, so a CORS preflight (which carries no key) is answered and
a 401 still carries CORS headers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from mmserve.config import EngineConfig, ServerConfig
from mmserve.entrypoints.openai.collector import Collector
from mmserve.entrypoints.openai.drain import Drain
from mmserve.entrypoints.openai.errors import OpenAIError, bad_request
from mmserve.entrypoints.openai.files import files_router, open_file_store
from mmserve.entrypoints.openai.middleware import ApiKeyAuth, BodySizeLimit, HostCheck, InFlight, OriginCheck
from mmserve.entrypoints.openai.parsing import describe_validation
from mmserve.entrypoints.openai.routes import WEB_DIR, router
from mmserve.entrypoints.openai.state import AppState
from mmserve.entrypoints.startup import startup_report
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.metrics import ServerMetrics

logger = logging.getLogger("mmserve.api_server")

_WORKER_THREADS = 32


@asynccontextmanager
async def serving(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    on_engine_dead: Callable[[], None] | None,
    drain: Drain,
    in_flight: InFlight,
) -> AsyncIterator[AppState]:
    """The routes' state while the server runs: the frontend and a started EngineCore."""
    # Requests do their CPU work (parsing, images, tokenising, answers) and their image
    # fetches (up to 10 s each) in threads: the default pool (cores + 4) is too few to let a
    # handful of slow fetches not hold up everyone else's work.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=_WORKER_THREADS, thread_name_prefix="mmserve-request")
    )
    start = time.perf_counter()
    media = MediaLoader(server_config.allowed_local_media_path, list(server_config.allowed_media_domains))
    frontend = build_frontend(
        engine_config,
        media,
        open_ended=True,
        special_tokens_in_content=server_config.allow_special_tokens_in_content,
        chat_template=server_config.chat_template,
    )
    metrics = ServerMetrics(server_config.served_model_name, engine_config.model.max_model_len)

    def on_outputs(_snapshots, stats) -> None:
        if stats is not None:
            metrics.update_engine(stats)

    engine = AsyncLLM(
        engine_config,
        frontend.outputs,
        on_engine_dead=on_engine_dead,
        on_outputs=on_outputs,
        inputs=frontend.inputs,
    )
    files = open_file_store(server_config)
    try:
        await engine.start()
    except BaseException:
        frontend.close()
        files.close()
        await engine.shutdown()
        raise
    report = startup_report(
        engine_config,
        server_config,
        engine.client.ready,
        engine_pid=engine.client.process.pid,
        num_preprocess_workers=len(frontend.pool.worker_pids()),
        segment_prefix=frontend.pool.segment_prefix,
        start_time_s=time.perf_counter() - start,
    )
    drain.attach(engine)
    # Busy while a request is served, not only while the engine runs it: a large answer is
    # built after its engine request finished, and a full collection would walk all of it.
    collector = Collector(busy=lambda: in_flight.count > 0 or engine.num_unfinished > 0)
    collector.start()
    logger.info(report)
    try:
        yield AppState(engine, frontend, metrics, server_config, drain, files.store)
    finally:
        collector.stop()
        # Stop both at once: a supervisor's SIGTERM grace period is short.
        await asyncio.gather(engine.shutdown(), asyncio.to_thread(frontend.close))
        files.close()


def build_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    on_engine_dead: Callable[[], None] | None = None,
    drain: Drain | None = None,
) -> ASGIApp:
    """The whole ASGI app: routes, error handlers and the middleware (see the module doc)."""
    drain = drain or Drain(server_config.shutdown_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with serving(engine_config, server_config, on_engine_dead, drain, in_flight) as state:
            app.state.mmserve = state
            yield

    app = FastAPI(title="mmserve", lifespan=lifespan)
    _add_error_handlers(app)
    if server_config.api_keys:
        app.add_middleware(ApiKeyAuth, api_keys=server_config.api_keys)
    if server_config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server_config.allowed_origins),
            allow_credentials=server_config.allow_credentials,
            allow_methods=list(server_config.allowed_methods),
            allow_headers=list(server_config.allowed_headers),
        )
    app.include_router(router)
    app.include_router(files_router)
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    limited = BodySizeLimit(app, server_config.max_body_bytes)
    in_flight = InFlight(
        HostCheck(OriginCheck(limited, server_config.allowed_origins), server_config.served_hosts)
    )
    return in_flight  # (the lifespan above reads it at start-up)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body with the right status."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, e: Exception) -> JSONResponse:
        # Starlette still re-raises `e` afterwards, so the traceback reaches the log.
        return OpenAIError(500, f"internal error: {type(e).__name__}").response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        # Routing's own answers (404 no such route, 405 wrong method), Starlette's {"detail"} before.
        path = request.url.path if len(request.url.path) <= 64 else request.url.path[:61] + "..."
        if e.status_code == 404:
            message = f"no route {path!r} on this server"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {path!r}"
        else:
            message = str(e.detail)
        response = OpenAIError(e.status_code, message).response()
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return bad_request(describe_validation(e.errors())).response()
