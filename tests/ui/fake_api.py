"""A scripted stand-in for the server's API (page.route), for the chat page's offline tests."""

from __future__ import annotations

import json

from chat_page import OFFLINE_URL, serve_web_dir
from playwright.sync_api import Page, Route

MODEL = "tiny-model"


class FakeApi:
    """Answers /v1/models, /v1/chat/completions and /v1/files in the server's formats, and records
    requests."""

    def __init__(self) -> None:
        self.requests: list[dict] = []  # {"headers": ..., "body": ...} of each chat request
        self.deltas = ["Hello", " **world**"]
        self.status = 200  # a status >= 400 answers {"error": ...} with `error` as the message
        self.error = ""
        self.error_mid_stream = False  # stream `deltas`, then an error frame
        self.models_status = 200
        self.timing = {"time_to_first_token_s": 0.05, "decode_time_s": 0.25}  # the server's
        self.files_status = 404  # POST /v1/files: 404 is a server without a Files API
        self.uploads: list[dict] = []  # {"headers", "body"} of each POST /v1/files
        self.deleted: list[str] = []  # file ids, in the order DELETE /v1/files/{id} came
        self.held_uploads: list[Route] | None = None  # a list: uploads wait there to be answered

    def models(self, route: Route) -> None:
        if self.models_status != 200:
            return route.fulfill(
                status=self.models_status, json=self.error_body("missing or invalid API key")
            )
        route.fulfill(json={"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def chat(self, route: Route) -> None:
        self.requests.append({"headers": route.request.headers, "body": route.request.post_data_json})
        if self.status != 200:
            return route.fulfill(status=self.status, json=self.error_body(self.error))
        frames = [
            {"choices": [{"index": 0, "delta": {"content": d}, "finish_reason": None}]} for d in self.deltas
        ]
        if self.error_mid_stream:
            frames.append(self.error_body(self.error))
        else:
            usage = {"prompt_tokens": 40, "completion_tokens": len(self.deltas), "total_tokens": 40}
            usage |= {"prompt_tokens_details": {"cached_tokens": 30}}
            frames.append({"choices": [], "usage": usage, "timing": self.timing})
        body = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"
        route.fulfill(body=body, content_type="text/event-stream")

    def files(self, route: Route) -> None:
        request = route.request
        if request.method == "DELETE":
            self.deleted.append(request.url.rsplit("/", 1)[1])
            return route.fulfill(json={"id": self.deleted[-1], "object": "file", "deleted": True})
        self.uploads.append({"headers": request.headers, "body": request.post_data_buffer})
        if self.held_uploads is not None:
            return self.held_uploads.append(route)
        self.answer_upload(route, len(self.uploads) - 1)

    def answer_upload(self, route: Route, index: int) -> None:
        if self.files_status != 200:
            return route.fulfill(status=self.files_status, json=self.error_body(self.error))
        route.fulfill(json={"id": self.file_id(index), "object": "file", "purpose": "vision"})

    def release_uploads(self) -> None:
        """Answer the held uploads, and the next ones at once."""
        held, self.held_uploads = self.held_uploads, None
        for index, route in enumerate(held):
            self.answer_upload(route, len(self.uploads) - len(held) + index)

    @staticmethod
    def file_id(index: int) -> str:
        return f"file-{index:032x}"

    def error_body(self, message: str) -> dict:
        return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 400}}

    def last_messages(self) -> list[dict]:
        return self.requests[-1]["body"]["messages"]

    def serve(self, page: Page) -> FakeApi:
        """Answer the page's OFFLINE_URL: its files, and the API from this object."""
        serve_web_dir(page)
        page.route(OFFLINE_URL + "v1/models", self.models)
        page.route(OFFLINE_URL + "v1/chat/completions", self.chat)
        page.route(OFFLINE_URL + "v1/files**", self.files)
        return self
