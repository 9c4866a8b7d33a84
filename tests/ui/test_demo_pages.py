"""The chat page and the dashboard on the bundled demo model (real answers). Screenshots,
desktop and phone, light and dark, of the empty page with its samples, a two-turn chat and the
dashboard are written to tests/ui/screenshots for a person to look at; the assertions check what
they must show."""

from __future__ import annotations

import base64
import re
import time

import httpx
import pytest
from chat_page import ChatPage
from playwright.sync_api import Page, expect

from mmserve.cli import DEMO_MODEL
from mmserve.entrypoints.openai.routes import WEB_DIR
from mmserve.testing.server import ServerProcess

VIEWPORTS = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    args = ("--preprocess-workers", "1", "--kv-cache-memory", "64MiB")
    proc = ServerProcess(DEMO_MODEL, *args, log_path=tmp_path_factory.mktemp("demo") / "log")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def shoot(page: Page, name: str, folder) -> None:
    for device, size in VIEWPORTS.items():
        page.set_viewport_size(size)
        assert page.evaluate("document.documentElement.scrollWidth") <= size["width"], device
        for scheme in ("light", "dark"):
            page.emulate_media(color_scheme=scheme)
            page.screenshot(path=folder / f"{name}-{device}-{scheme}.png")
    page.set_viewport_size(VIEWPORTS["desktop"])
    page.emulate_media(color_scheme="light")


def test_the_empty_page_and_a_two_turn_chat(page, demo_server, screenshot_dir):
    page.emulate_media(reduced_motion="reduce")
    chat = ChatPage(page, demo_server.url + "/").open()
    samples = chat.thread.locator(".sample img")
    expect(samples).to_have_count(2)
    for index in range(2):
        expect(samples.nth(index)).to_have_js_property("complete", True)
    shoot(page, "empty", screenshot_dir)

    chat.set_settings(max_tokens=48)
    page.get_by_role("checkbox", name="Greedy").check()
    page.get_by_role("button", name="What colour is the circle?").click()
    first = chat.wait_for_answer(0, timeout_s=120)
    expect(first.locator(".markdown")).to_have_text("The circle is red.")
    chat.send("How many shapes are there?")
    second = chat.wait_for_answer(1, timeout_s=120)
    expect(second.locator(".markdown")).not_to_be_empty()
    expect(second.locator("[data-stat=sampling]")).to_have_text("greedy")
    shoot(page, "two-turn-chat", screenshot_dir)


def number(text: str) -> float | None:
    match = re.match(r"[0-9.]+", text)
    return float(match.group()) if match else None


def wait_for_number(page: Page, selector: str, timeout_s: float = 20) -> float:
    """The chart value at `selector` once it is a number above 0 (the page polls every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while (value := number(page.locator(selector).inner_text()) or 0) <= 0:
        assert time.monotonic() < deadline, f"{selector} still {page.locator(selector).inner_text()!r}"
        time.sleep(0.25)
    return value


def ask(server: ServerProcess, question: str) -> None:
    picture = base64.b64encode((WEB_DIR / "samples" / "shapes.png").read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}}]
    body = {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]}
    response = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 16}, timeout=60)
    response.raise_for_status()


def test_the_dashboard_is_linked_from_the_chat_page_and_charts_the_metrics(page, demo_server, screenshot_dir):
    page.emulate_media(reduced_motion="reduce")
    ChatPage(page, demo_server.url + "/").open()
    page.get_by_role("link", name="Dashboard").click()
    expect(page).to_have_url(demo_server.url + "/dashboard")
    expect(page.locator(".chart")).to_have_count(9)
    expect(page.locator("#dashboard-status")).to_contain_text("updated")
    for question in ("What colour is the circle?", "How many shapes are there?"):
        ask(demo_server, question)  # the same picture twice: prefix-cache hits on the second
    assert wait_for_number(page, "[data-chart=tokens] [data-series=generation]") > 0
    assert wait_for_number(page, "[data-chart=ttft] [data-series=p50]") > 0
    assert wait_for_number(page, "[data-chart=itl] [data-series=p90]") > 0
    assert 0 < wait_for_number(page, "[data-chart=prefix] [data-series=hits]") <= 100
    # The same picture a second time goes to the engine by hash (it holds the embeddings), so it
    # never reaches the preprocess cache whose hit rate the mm-cache chart shows: that chart is
    # charted but has no ratio to show yet.
    expect(page.locator("[data-chart=mm-cache] [data-series=hits]")).to_have_text(
        re.compile(r"^(–|\d+(\.\d)? %)$")
    )
    expect(page.locator("[data-chart=kv] [data-series=usage]")).to_have_text(re.compile(r"\d+(\.\d)? %"))
    expect(page.locator("[data-chart=requests] [data-series=running]")).to_have_text(re.compile(r"\d"))
    # a line of a few points in each percentile chart before the screenshot
    ttft_line = page.locator("[data-chart=ttft] polyline").first
    expect(ttft_line).to_have_attribute("points", re.compile(r"^\S+ \S+ \S+"), timeout=20_000)
    shoot(page, "dashboard", screenshot_dir)
