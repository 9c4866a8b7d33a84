"""OpenAI's Files API for images: `POST /v1/files` (multipart: `file`, `purpose`), `GET
/v1/files`, `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

An upload is checked and preprocessed before it is stored (a file that is not an image, a
decompression bomb, one over the size limit: 4xx, nothing stored), so the first chat turn that
uses it finds its pixels in the preprocess cache. Chat messages refer to a file by id
(`{"type": "image_file", "image_file": {"file_id"}}` or `{"type": "file", "file": {"file_id"}}`),
resolved with `resolver_for` as the caller's key. The store is frontend/file_store.py.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from mmserve.config import ServerConfig
from mmserve.entrypoints.openai.errors import OpenAIError, bad_request
from mmserve.entrypoints.openai.state import AppState, app_state
from mmserve.frontend.errors import ImageError
from mmserve.frontend.file_store import FileNotFound, FileResolver, FileStore, QuotaExceeded

PURPOSES = ("vision", "user")  # what an image is uploaded as in OpenAI's API

files_router = APIRouter()
State = Annotated[AppState, Depends(app_state)]


@dataclass
class OpenedStore:
    """The server's file store, and the temporary folder to remove at exit if it made one."""

    store: FileStore
    temporary_dir: str | None = None

    def close(self) -> None:
        if self.temporary_dir is not None:
            shutil.rmtree(self.temporary_dir, ignore_errors=True)


def open_file_store(server: ServerConfig) -> OpenedStore:
    temporary = None if server.files_dir else tempfile.mkdtemp(prefix="mmserve-files-")
    store = FileStore(
        server.files_dir or temporary,
        max_bytes=server.files_quota_bytes,
        max_files=server.files_quota_count,
        ttl_s=server.files_ttl_s,
    )
    return OpenedStore(store, temporary)


def owner_of(raw: Request, server: ServerConfig) -> str:
    """The files' owner for this request: a digest of its API key ("" when the server has none;
    the key itself is never stored). ApiKeyAuth has already checked the key."""
    if not server.api_keys:
        return ""
    header = raw.headers.get("authorization", "")
    key = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def resolver_for(raw: Request, state: AppState) -> FileResolver | None:
    return None if state.files is None else state.files.resolver(owner_of(raw, state.server))


def _store(state: AppState) -> FileStore:
    if state.files is None:
        raise OpenAIError(404, "this server has no Files API")
    return state.files


def _not_found(e: FileNotFound) -> OpenAIError:
    return OpenAIError(404, str(e), "file_id")


_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"enum": list(PURPOSES)},
                    },
                }
            }
        },
    }
}


@files_router.post("/v1/files", openapi_extra=_UPLOAD_BODY)
async def upload_file(raw: Request, state: State) -> JSONResponse:
    store = _store(state)
    try:
        form = await raw.form(max_files=1, max_fields=8)
    except HTTPException as e:  # a malformed multipart body
        raise bad_request(f"malformed upload: {e.detail}", "file") from None
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("the multipart field 'file' is required", "file")
        if purpose not in PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(PURPOSES)} (images only)", "purpose")
        limit = state.server.max_file_bytes
        data = await upload.read(limit + 1)
        filename = upload.filename or "upload"
    finally:
        await form.close()  # removes the parts spooled to disk
    if len(data) > limit:
        raise OpenAIError(413, f"the file exceeds the {limit} byte limit", "file")
    if not data:
        raise bad_request("the file is empty", "file")
    mm_hash = await _preprocess(state, data)
    try:
        stored = store.add(owner_of(raw, state.server), filename, purpose, data, mm_hash)
    except QuotaExceeded as e:
        raise OpenAIError(403, str(e), "file", "quota_exceeded") from None
    return JSONResponse(stored.to_openai())


async def _preprocess(state: AppState, data: bytes) -> str:
    """Check the image (decodable, within every limit) and leave its pixels in the preprocess
    cache; its mm_hash, computed here from the bytes."""
    try:
        return await state.frontend.inputs.media.preprocess_upload_async(data)
    except ImageError as e:
        raise bad_request(f"the file is not an image that can be served: {e}", "file") from None


@files_router.get("/v1/files")
async def list_files(raw: Request, state: State, purpose: str | None = None) -> dict:
    files = _store(state).list_files(owner_of(raw, state.server), purpose)
    return {"object": "list", "data": [f.to_openai() for f in files], "has_more": False}


@files_router.get("/v1/files/{file_id}")
async def retrieve_file(raw: Request, state: State, file_id: str) -> dict:
    try:
        return _store(state).get(owner_of(raw, state.server), file_id).to_openai()
    except FileNotFound as e:
        raise _not_found(e) from None


@files_router.get("/v1/files/{file_id}/content")
async def file_content(raw: Request, state: State, file_id: str) -> Response:
    try:
        data = _store(state).read(owner_of(raw, state.server), file_id)
    except FileNotFound as e:
        raise _not_found(e) from None
    return Response(data, media_type="application/octet-stream")


@files_router.delete("/v1/files/{file_id}")
async def delete_file(raw: Request, state: State, file_id: str) -> dict:
    try:
        stored = _store(state).delete(owner_of(raw, state.server), file_id)
    except FileNotFound as e:
        raise _not_found(e) from None
    return {"id": stored.id, "object": "file", "deleted": True}
