"""How the frontend reaches EngineCore. In-process here; the serving path adds a ZeroMQ client
with the same methods."""

from __future__ import annotations

from collections.abc import Iterable

from mmserve.core.engine_core import EngineCore
from mmserve.protocol import EngineCoreOutputs, EngineRequest


class InprocCoreClient:
    """EngineCore in the caller's process: each `get_output` runs one engine step."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core

    def add_request(self, request: EngineRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.engine_core.abort_requests(list(request_ids))

    def has_work(self) -> bool:
        return self.engine_core.has_work()

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()
