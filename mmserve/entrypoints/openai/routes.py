"""The API server's routes. Each reaches the shared `AppState` through the `State` dependency;
the JSON routes parse their own bodies (`parse_body`) and publish the schema (`json_body`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from mmserve.entrypoints.openai.disconnect import until_disconnected
from mmserve.entrypoints.openai.errors import OpenAIError, bad_request
from mmserve.entrypoints.openai.files import resolver_for
from mmserve.entrypoints.openai.generation import Generation, check_request, client_error
from mmserve.entrypoints.openai.parsing import json_body, parse_body
from mmserve.entrypoints.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from mmserve.entrypoints.openai.serving import (
    build_chat,
    build_completion,
    chat_response,
    chat_stream,
    completion_response,
    completion_stream,
)
from mmserve.entrypoints.openai.state import AppState, app_state

WEB_DIR = Path(__file__).resolve().parents[2] / "web"

router = APIRouter()
State = Annotated[AppState, Depends(app_state)]


@router.get("/health")
async def health(state: State) -> Response:
    if state.engine.dead:
        return OpenAIError(503, "the engine is not running").response()
    if state.drain.draining:  # so a load balancer stops sending before the deadline
        return OpenAIError(503, "the server is shutting down").response()
    return JSONResponse({})


@router.get("/version", include_in_schema=False)
async def version() -> dict:
    """Public, as vLLM's (the API-key check covers /v1 and the tokenizer routes only)."""
    return {"version": installed_version("mmserve")}


@router.get("/v1/models")
async def models(state: State) -> dict:
    """One card per served name (vLLM's habit), each a name of the same model."""
    return {"object": "list", "data": [_model_card(state, name) for name in state.server.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State) -> dict:
    if model_id not in state.server.served_model_names:
        shown = model_id if len(model_id) <= 64 else model_id[:61] + "..."
        raise OpenAIError(404, f"the model {shown!r} does not exist", "model", "model_not_found")
    return _model_card(state, model_id)


def _model_card(state: AppState, name: str) -> dict:
    model_config = state.engine.config.model
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "mmserve",
        "root": str(model_config.path),
        "max_model_len": model_config.max_model_len,
    }


@router.get("/metrics")
async def metrics(state: State) -> Response:
    stats = state.frontend.pool.stats()
    state.metrics.update_preprocess(stats.cache_queries, stats.cache_hits, stats.pending)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(raw: Request, state: State) -> Response:
    request = await parse_body(raw, ChatCompletionRequest)
    generation = await build_chat(state, request, resolver_for(raw, state))
    return await _respond(raw, request, generation, chat_stream, chat_response)


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(raw: Request, state: State) -> Response:
    request = await parse_body(raw, CompletionRequest)
    generation = await build_completion(state, request)
    return await _respond(raw, request, generation, completion_stream, completion_response)


async def _respond(
    raw: Request,
    request: ChatCompletionRequest | CompletionRequest,
    generation: Generation,
    stream_body: Callable[[Generation, ChatCompletionRequest | CompletionRequest], AsyncIterator[str]],
    response_body: Callable[[Generation], Awaitable[bytes]],
) -> Response:
    """An SSE stream if the request asked for one, else the JSON body (abandoned, and its
    engine requests aborted, if the client leaves first)."""
    if request.stream:
        return StreamingResponse(stream_body(generation, request), media_type="text/event-stream")
    body = await until_disconnected(raw, response_body(generation))  # JSON, rendered off the loop
    return Response(body, media_type="application/json")


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(raw: Request, state: State) -> dict:
    request = await parse_body(raw, TokenizeRequest)
    check_request(state, request.model, 0)
    inputs = state.frontend.inputs
    try:
        if request.messages is not None:
            add_generation_prompt = request.add_generation_prompt
            prompt = await inputs.chat_async(request.messages, add_generation_prompt=add_generation_prompt)
        elif request.prompt is not None:
            prompt = await inputs.prompt_async(request.prompt)
        else:
            raise bad_request("give either prompt or messages")
    except Exception as e:
        raise client_error(e) from None
    max_model_len = state.engine.config.model.max_model_len
    return {"tokens": prompt.token_ids, "count": len(prompt.token_ids), "max_model_len": max_model_len}


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(raw: Request, state: State) -> dict:
    request = await parse_body(raw, DetokenizeRequest)
    check_request(state, request.model, 0)
    tokenizer = state.frontend.tokenizer
    if any(not 0 <= token < tokenizer.vocab_size for token in request.tokens):
        raise bad_request(f"token ids must be in [0, {tokenizer.vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}


@router.get("/", include_in_schema=False)
async def chat_page() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html")


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> FileResponse:
    """Charts of /metrics over the last minutes, drawn in the browser (no state here)."""
    return FileResponse(WEB_DIR / "dashboard.html")
