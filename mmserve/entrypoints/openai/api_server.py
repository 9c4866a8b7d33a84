"""The API server process: FastAPI routes over AsyncLLM, the preprocess pool, and EngineCore.

Start-up (lifespan) builds the frontend (tokenizer, preprocess pool, input processor) and starts
the EngineCore process; shutdown stops them. If EngineCore dies, /health turns 503 at once, open
requests fail, and `on_engine_dead` is called (the CLI then exits with a non-zero status, so a
supervisor restarts the server).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp

from mmserve.config import EngineConfig, ServerConfig
from mmserve.entrypoints.openai.errors import OpenAIError, bad_request
from mmserve.entrypoints.openai.middleware import ApiKeyAuth, BodySizeLimit
from mmserve.entrypoints.openai.parsing import describe_validation
from mmserve.entrypoints.openai.routes import WEB_DIR, router
from mmserve.entrypoints.openai.state import AppState
from mmserve.entrypoints.startup import startup_report
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.metrics import ServerMetrics

logger = logging.getLogger("mmserve.api_server")


@asynccontextmanager
async def serving(
    engine_config: EngineConfig, server_config: ServerConfig, on_engine_dead: Callable[[], None] | None
) -> AsyncIterator[AppState]:
    """The routes' state while the server runs: the frontend and a started EngineCore."""
    start = time.perf_counter()
    media = MediaLoader(server_config.allowed_local_media_path, list(server_config.allowed_media_domains))
    frontend = build_frontend(
        engine_config, media, open_ended=True, chat_template=server_config.chat_template
    )
    metrics = ServerMetrics(server_config.served_model_name, engine_config.model.max_model_len)

    def on_outputs(_snapshots, stats) -> None:
        if stats is not None:
            metrics.update_engine(stats)

    engine = AsyncLLM(engine_config, frontend.outputs, on_engine_dead=on_engine_dead, on_outputs=on_outputs)
    try:
        await engine.start()
    except BaseException:
        frontend.close()
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
    logger.info(report)
    try:
        yield AppState(engine, frontend, metrics, server_config)
    finally:
        # Stop both at once: a supervisor's SIGTERM grace period is short.
        await asyncio.gather(engine.shutdown(), asyncio.to_thread(frontend.close))


def build_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    on_engine_dead: Callable[[], None] | None = None,
) -> ASGIApp:
    """The whole ASGI app: routes, error handlers, API-key check, body size limit outermost."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with serving(engine_config, server_config, on_engine_dead) as state:
            app.state.mmserve = state
            yield

    app = FastAPI(title="mmserve", lifespan=lifespan)
    _add_error_handlers(app)
    if server_config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=server_config.api_key)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return BodySizeLimit(app, server_config.max_body_bytes)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body with the right status."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, e: Exception) -> JSONResponse:
        # Starlette still re-raises `e` afterwards, so the traceback reaches the log.
        return OpenAIError(500, f"internal error: {type(e).__name__}").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, e: RequestValidationError) -> JSONResponse:
        return bad_request(describe_validation(e.errors())).response()
