"""The chat page against a real `mmserve serve` on the tiny random-weight Qwen2-VL.

Answers are gibberish but deterministic at temperature 0, so the page's answer can be compared
with what the API returns for the same request.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from api_reference import MAX_TOKENS, SERVER_ARGS, api_answer, user_turn
from chat_page import ChatPage
from playwright.sync_api import expect
from prometheus_client.parser import text_string_to_metric_families

from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "log"
    proc = ServerProcess(checkpoint("qwen2_vl"), *SERVER_ARGS, log_path=log_path)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def chat(page, server) -> ChatPage:
    chat = ChatPage(page, server.url + "/").open()
    chat.set_settings(temperature=0, max_tokens=MAX_TOKENS)
    return chat


def requests_running(server) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^mmserve:num_requests_running\{.*\} (\S+)$", metrics, re.M).group(1))


def test_streamed_answer_equals_the_api_answer(chat, server, image_paths, context):
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    expected = api_answer(server, [user_turn("What is in this picture?", image_paths[0])])

    chat.attach(image_paths[0])
    chat.slow_down_streams(50)
    # Record whether part of the answer is on screen while it is still being generated (watched
    # from inside the page: the whole answer may take less time than one poll from here).
    chat.page.evaluate(
        """() => {
            window.partialAnswerSeen = false;
            new MutationObserver(() => {
                const busy = document.querySelector(".message.assistant[aria-busy=true] .markdown");
                if (busy && busy.textContent.length) window.partialAnswerSeen = true;
            }).observe(document.body, {
                subtree: true, childList: true, characterData: true, attributes: true,
            });
        }"""
    )
    chat.send("What is in this picture?")
    answer = chat.wait_for_answer(0)
    assert chat.page.evaluate("window.partialAnswerSeen")

    assert answer.locator(".markdown").inner_html() == chat.render_markdown(expected)
    answer.get_by_role("button", name="Copy the answer").click()
    assert chat.page.evaluate("navigator.clipboard.readText()") == expected
    expect(answer.locator("[data-stat=completion]")).to_have_text(f"{MAX_TOKENS} completion")
    expect(answer.locator("[data-stat=ttft]")).to_have_text(re.compile(r"TTFT \d"))
    expect(answer.locator("[data-stat=speed]")).to_have_text(re.compile(r"\d+\.\d tok/s"))
    expect(chat.user_messages.first.locator("img")).to_have_count(1)


def test_second_turn_about_the_same_image_shows_a_prefix_cache_hit(chat, image_paths):
    chat.attach(image_paths[1])
    chat.send("Describe the image.")
    chat.wait_for_answer(0)
    chat.send("What colour is the largest shape?")
    second = chat.wait_for_answer(1)

    share = second.locator("[data-stat=cache]").inner_text()
    assert int(re.fullmatch(r"cache (\d+)%", share).group(1)) > 0


def test_conversation_survives_a_reload(chat, image_paths):
    chat.attach(image_paths[0])
    chat.send("Remember this picture.")
    answer_html = chat.wait_for_answer(0).locator(".markdown").inner_html()
    chat.page.get_by_role("button", name="Rename Remember this picture.").click()
    chat.page.get_by_role("textbox", name="New title").fill("Picture notes")
    chat.page.keyboard.press("Enter")
    chat.wait_until_stored("Picture notes")

    chat.page.reload()

    expect(chat.conversations).to_have_count(1)
    expect(chat.page.get_by_role("button", name="Picture notes", exact=True)).to_have_attribute(
        "aria-current", "true"
    )
    expect(chat.user_messages).to_have_count(1)
    expect(chat.user_messages.first).to_contain_text("Remember this picture.")
    image = chat.user_messages.first.locator("img")
    expect(image).to_have_js_property("complete", True)
    assert image.evaluate("img => img.naturalWidth") == 224
    assert chat.answers.first.locator(".markdown").inner_html() == answer_html
    expect(chat.answers.first.locator("[data-stat=cache]")).to_be_visible()


def test_stop_ends_the_stream_and_leaves_the_page_usable(chat, server, image_paths):
    chat.set_settings(max_tokens=2000)
    chat.attach(image_paths[0])
    chat.send("Tell me a long story about this picture.")
    streaming = chat.page.locator(".message.assistant[aria-busy=true] .markdown")
    expect(streaming).not_to_be_empty()
    chat.page.get_by_role("button", name="Stop").click()

    answer = chat.wait_for_answer(0, timeout_s=5)
    expect(answer).to_contain_text("Stopped.")
    stopped_text = answer.locator(".markdown").inner_text()
    deadline = time.monotonic() + 10
    while requests_running(server) and time.monotonic() < deadline:  # the server aborted it too
        time.sleep(0.2)
    assert requests_running(server) == 0
    assert answer.locator(".markdown").inner_text() == stopped_text

    expect(chat.page.get_by_role("button", name="Send", exact=True)).to_be_visible()
    chat.set_settings(max_tokens=MAX_TOKENS)
    chat.send("A short one, then.")
    expect(chat.wait_for_answer(1).locator("[data-stat=completion]")).to_have_text(f"{MAX_TOKENS} completion")


def test_server_error_is_shown_inline_and_regenerate_recovers(chat, image_paths):
    chat.set_settings(temperature=-1)
    chat.attach(image_paths[0])
    chat.send("This request is invalid.")

    error = chat.wait_for_answer(0).locator(".error")
    expect(error).to_contain_text("temperature must be non-negative")
    expect(error).to_contain_text("HTTP 400")
    expect(chat.user_messages).to_have_count(1)

    chat.set_settings(temperature=0)
    chat.answers.first.get_by_role("button", name="Regenerate this answer").click()
    answer = chat.wait_for_answer(0)
    expect(answer.locator(".error")).to_have_count(0)
    expect(answer.locator("[data-stat=completion]")).to_have_text(f"{MAX_TOKENS} completion")


def test_layouts_wide_and_narrow(chat, image_paths, screenshot_dir):
    chat.attach(*image_paths)
    chat.send("Compare these two pictures.\n\nAnswer briefly.")
    chat.wait_for_answer(0)
    chat.page.screenshot(path=screenshot_dir / "wide.png")

    chat.page.emulate_media(color_scheme="dark")
    chat.page.screenshot(path=screenshot_dir / "wide-dark.png")
    chat.page.emulate_media(color_scheme="light")

    chat.page.emulate_media(reduced_motion="reduce")  # no sliding drawer half-way in a screenshot
    chat.page.set_viewport_size({"width": 390, "height": 844})
    sidebar = chat.page.get_by_role("complementary", name="Conversations")
    expect(sidebar).to_be_hidden()
    expect(chat.prompt).to_be_in_viewport()
    assert chat.page.evaluate("document.documentElement.scrollWidth") <= 390
    chat.page.screenshot(path=screenshot_dir / "narrow.png")

    chat.page.get_by_role("button", name="Show conversations").click()
    expect(sidebar).to_be_visible()
    chat.page.screenshot(path=screenshot_dir / "narrow-sidebar.png")
    chat.page.keyboard.press("Escape")
    expect(sidebar).to_be_hidden()
    expect(chat.page.get_by_role("button", name="Show conversations")).to_be_focused()


def server_decode_figures(server) -> tuple[float, float]:
    """(generated tokens, decode seconds) the server has counted so far, from its /metrics."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}

    def total(family: str, sample: str) -> float:
        return sum(s.value for s in families[family].samples if s.name == sample)

    tokens = total("mmserve:generation_tokens", "mmserve:generation_tokens_total")
    decode_s = total("mmserve:request_decode_time_seconds", "mmserve:request_decode_time_seconds_sum")
    return tokens, decode_s


def test_speed_is_the_servers_figure_when_tokens_arrive_in_bursts(chat, server, image_paths):
    """Five events per network read: the page's own clock would see most tokens arrive at once."""
    chat.set_settings(max_tokens=24)
    tokens_before, decode_before = server_decode_figures(server)
    chat.attach(image_paths[0])
    chat.deliver_streams_in_bursts(events_per_burst=5, ms_between=40)
    chat.send("What is in this picture?")
    answer = chat.wait_for_answer(0)
    tokens_after, decode_after = server_decode_figures(server)
    server_speed = (tokens_after - tokens_before - 1) / (decode_after - decode_before)
    shown = answer.locator("[data-stat=speed]").inner_text()
    page_speed = float(re.fullmatch(r"(\d+\.\d) tok/s", shown).group(1))
    assert abs(page_speed - server_speed) <= 0.2 * server_speed, (page_speed, server_speed)


def test_greedy_is_one_click_and_gives_the_apis_greedy_answer(page, server, image_paths):
    chat = ChatPage(page, server.url + "/").open()
    chat.set_settings(temperature="", max_tokens=MAX_TOKENS)
    summary = page.locator("#sampling-summary")
    expect(summary).to_contain_text("default temperature: answers vary")
    page.get_by_role("checkbox", name="Greedy").check()
    expect(summary).to_contain_text("Greedy (temperature 0)")
    expected = api_answer(server, [user_turn("What is in this picture?", image_paths[1])])

    chat.attach(image_paths[1])
    chat.send("What is in this picture?")
    answer = chat.wait_for_answer(0)
    assert answer.locator(".markdown").inner_html() == chat.render_markdown(expected)
    expect(answer.locator("[data-stat=sampling]")).to_have_text("greedy")
