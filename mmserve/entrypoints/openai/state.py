"""What the API server's routes share, built once at start-up (see api_server.lifespan)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from mmserve.config import ServerConfig
from mmserve.entrypoints.openai.drain import Drain
from mmserve.frontend.async_llm import AsyncLLM
from mmserve.frontend.factory import Frontend
from mmserve.frontend.file_store import FileStore
from mmserve.metrics import ServerMetrics


@dataclass
class AppState:
    engine: AsyncLLM
    frontend: Frontend
    metrics: ServerMetrics
    server: ServerConfig
    drain: Drain
    files: FileStore | None = None  # the Files API's store
    created: int = field(default_factory=lambda: int(time.time()))  # unix seconds, for /v1/models

    @property
    def served_model_name(self) -> str:
        return self.server.served_model_name


def app_state(request: Request) -> AppState:
    """The FastAPI dependency that hands a route the state (set on `app.state` by the lifespan)."""
    return request.app.state.mmserve
