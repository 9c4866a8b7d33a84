"""A page object for the chat page, and a way to load the page with no server behind it."""

from __future__ import annotations

import json
import mimetypes
import time
from dataclasses import dataclass
from pathlib import Path

from playwright.sync_api import Page, Request, Route, expect

WEB_DIR = Path(__file__).resolve().parents[2] / "mmserve" / "web"

# A secure-context origin (clipboard, like the real server on 127.0.0.1) that never reaches the
# network: page.route answers every request to it.
OFFLINE_URL = "http://localhost:9/"


def serve_web_dir(page: Page) -> None:
    """Answer OFFLINE_URL's page and /static/ files from mmserve/web, as the server would."""

    def handle(route: Route) -> None:
        path = route.request.url[len(OFFLINE_URL) :].split("?")[0]
        file = WEB_DIR / (path.removeprefix("static/") if path else "index.html")
        if not path or (path.startswith("static/") and file.is_file()):
            route.fulfill(path=file, content_type=mimetypes.guess_type(file.name)[0])
        else:
            route.fulfill(status=404, body="not found")

    page.route(OFFLINE_URL + "**", handle)


def stored_file_ids(messages: list[dict]) -> list[str | None]:
    """The file id of each image in saved messages (ChatPage.stored_messages), in order."""
    return [
        image["fileId"] for message in messages if message["role"] == "user" for image in message["images"]
    ]


@dataclass(frozen=True)
class Sent:
    method: str
    path: str  # from /v1/ on
    body: bytes


class ApiTraffic:
    """Every request the page sends to the API (/v1/...), as it went on the wire, in order."""

    def __init__(self, page: Page) -> None:
        self.sent: list[Sent] = []
        page.on("request", self._record)

    def _record(self, request: Request) -> None:
        path = request.url.split("?")[0]
        if "/v1/" in path:
            body = request.post_data_buffer or b""
            self.sent.append(Sent(request.method, path[path.index("/v1/") :], body))

    def uploads(self) -> int:
        """How many POST /v1/files (image uploads) the page sent. (Their multipart bodies hold a
        Blob, which Chromium does not report: read what arrived from the server instead.)"""
        return sum(s.method == "POST" and s.path == "/v1/files" for s in self.sent)

    def chat_bodies(self) -> list[bytes]:
        return [s.body for s in self.sent if s.path == "/v1/chat/completions"]

    def chat_messages(self) -> list[list[dict]]:
        return [json.loads(body)["messages"] for body in self.chat_bodies()]


class ChatPage:
    """What a user does on the chat page, in the page's own words (labels and roles)."""

    def __init__(self, page: Page, url: str) -> None:
        self.page = page
        self.url = url
        self.prompt = page.get_by_role("textbox", name="Message", exact=True)
        self.thread = page.locator("#thread")
        self.answers = page.locator(".message.assistant")
        self.user_messages = page.locator(".message.user")
        self.conversations = page.locator("#conversation-list .conversation")
        self.notice = page.locator("#notice")

    def open(self) -> ChatPage:
        self.page.goto(self.url)
        expect(self.prompt).to_be_editable()
        return self

    def slow_down_streams(self, ms_per_event: int) -> None:
        """Deliver each server-sent event of the page's streamed answers `ms_per_event` apart.

        A short answer from a tiny model can arrive within one animation frame, which the page
        then draws once; spacing the events out makes the stream arrive in pieces, as it does
        from a real model. (Wraps the page's fetch: Chromium's own network throttling delivers
        a streamed body in one piece.)
        """
        self.page.evaluate(
            """(delay) => {
                const fetchNow = window.fetch;
                window.fetch = async (...args) => {
                    const response = await fetchNow(...args);
                    if (!response.headers.get("content-type")?.startsWith("text/event-stream"))
                        return response;
                    let pending = "";
                    const spaced = new TransformStream({
                        async transform(text, controller) {
                            const events = (pending + text).split("\\n\\n");
                            pending = events.pop();
                            for (const event of events) {
                                await new Promise((resolve) => setTimeout(resolve, delay));
                                controller.enqueue(event + "\\n\\n");
                            }
                        },
                        flush(controller) { if (pending) controller.enqueue(pending); },
                    });
                    const body = response.body.pipeThrough(new TextDecoderStream())
                        .pipeThrough(spaced).pipeThrough(new TextEncoderStream());
                    return new Response(body, { status: response.status, headers: response.headers });
                };
            }""",
            ms_per_event,
        )

    def deliver_streams_in_bursts(self, events_per_burst: int, ms_between: int) -> None:
        """Hold the page's streamed events back and hand them over `events_per_burst` at a time
        (one read each), `ms_between` apart: as a proxy or a slow link delivers a stream."""
        self.page.evaluate(
            """([size, delay]) => {
                const fetchNow = window.fetch;
                window.fetch = async (...args) => {
                    const response = await fetchNow(...args);
                    if (!response.headers.get("content-type")?.startsWith("text/event-stream"))
                        return response;
                    let pending = "";
                    let held = [];
                    const bursts = new TransformStream({
                        async transform(text, controller) {
                            const events = (pending + text).split("\\n\\n");
                            pending = events.pop();
                            held.push(...events.map((event) => event + "\\n\\n"));
                            while (held.length >= size) {
                                await new Promise((resolve) => setTimeout(resolve, delay));
                                controller.enqueue(held.splice(0, size).join(""));
                            }
                        },
                        flush(controller) { controller.enqueue(held.join("") + pending); },
                    });
                    const body = response.body.pipeThrough(new TextDecoderStream())
                        .pipeThrough(bursts).pipeThrough(new TextEncoderStream());
                    return new Response(body, { status: response.status, headers: response.headers });
                };
            }""",
            [events_per_burst, ms_between],
        )

    def stored_titles(self) -> list[str]:
        """The conversation titles in the page's IndexedDB, as a reload would find them."""
        return self.page.evaluate(
            """() => new Promise((resolve, reject) => {
                const open = indexedDB.open("mmserve-chat");
                open.onerror = () => reject(open.error);
                open.onsuccess = () => {
                    const all = open.result.transaction("meta").objectStore("meta").getAll();
                    all.onsuccess = () => { open.result.close(); resolve(all.result.map((m) => m.title)); };
                    all.onerror = () => reject(all.error);
                };
            })"""
        )

    def stored_messages(self) -> list[list[dict]]:
        """Each saved conversation's messages, as a reload would find them."""
        return self.page.evaluate(
            """() => new Promise((resolve, reject) => {
                const open = indexedDB.open("mmserve-chat");
                open.onerror = () => reject(open.error);
                open.onsuccess = () => {
                    const all = open.result.transaction("messages").objectStore("messages").getAll();
                    all.onsuccess = () => {
                        open.result.close();
                        resolve(all.result.map((row) => row.messages));
                    };
                    all.onerror = () => reject(all.error);
                };
            })"""
        )

    def wait_until_stored_messages(self, count: int, timeout_s: float = 5) -> list[dict]:
        """The one saved conversation's messages once it holds `count` (see wait_until_stored)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stored = self.stored_messages()
            if [len(messages) for messages in stored] == [count]:
                return stored[0]
            assert time.monotonic() < deadline, f"saved {[len(m) for m in stored]} messages, not [{count}]"
            time.sleep(0.05)

    def wait_until_stored(self, *titles: str, timeout_s: float = 5) -> None:
        """Wait until the saved conversations are exactly those titled `titles`: the page writes
        in the background, and a reload sooner would cut the write off."""
        deadline = time.monotonic() + timeout_s
        while sorted(stored := self.stored_titles()) != sorted(titles):
            assert time.monotonic() < deadline, f"saved {stored}, not {list(titles)}"
            time.sleep(0.05)

    def set_settings(self, **fields: object) -> None:
        self.page.get_by_role("button", name="Settings").click()
        dialog = self.page.get_by_role("dialog", name="Settings")
        for name, value in fields.items():
            dialog.locator(f"[name={name}]").fill(str(value))
        dialog.get_by_role("button", name="Done").click()
        expect(dialog).to_be_hidden()

    def attach(self, *paths: Path) -> None:
        before = self.page.locator("#attachments img").count()
        self.page.locator("#file-input").set_input_files(list(paths))
        expect(self.page.locator("#attachments img")).to_have_count(before + len(paths))

    def send(self, text: str) -> None:
        self.prompt.fill(text)
        self.prompt.press("Enter")

    def wait_for_answer(self, index: int, timeout_s: float = 30):
        """The index-th answer once it has finished (streamed to the end, stopped, or failed)."""
        answer = self.answers.nth(index)
        expect(answer.locator(".actions")).to_be_attached(timeout=timeout_s * 1000)
        return answer

    def render_markdown(self, text: str) -> str:
        """The page's renderer applied to `text`, as the browser serialises it."""
        return self.page.evaluate(
            """async (text) => {
                const { renderMarkdown } = await import(new URL("static/markdown.js", document.baseURI));
                const probe = document.createElement("div");
                probe.innerHTML = renderMarkdown(text);
                return probe.innerHTML;
            }""",
            text,
        )
