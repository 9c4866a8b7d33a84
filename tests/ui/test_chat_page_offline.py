"""The chat page's own behaviour, against a scripted stand-in for the API (page.route).

The real server is covered by test_chat_page.py; here the answers are fixed, so each test checks
one behaviour of the page in a second or so.
"""

from __future__ import annotations

import base64

import pytest
from chat_page import OFFLINE_URL, ChatPage
from fake_api import MODEL, FakeApi
from playwright.sync_api import expect


@pytest.fixture
def api(page) -> FakeApi:
    return FakeApi().serve(page)


@pytest.fixture
def chat(page, api) -> ChatPage:
    return ChatPage(page, OFFLINE_URL).open()


def file_transfer(page, image_path, name: str):
    """A DataTransfer holding one PNG, as a drop or a paste delivers it."""
    return page.evaluate_handle(
        """([b64, name]) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, { type: "image/png" }));
            return transfer;
        }""",
        [base64.b64encode(image_path.read_bytes()).decode(), name],
    )


def test_images_attach_by_picker_drop_and_paste_and_can_be_removed(chat, api, image_paths):
    chat.attach(image_paths[0])
    chat.page.locator("#chat").dispatch_event(
        "drop", {"dataTransfer": file_transfer(chat.page, image_paths[1], "d.png")}
    )
    pasted = file_transfer(chat.page, image_paths[0], "p.png")
    chat.prompt.evaluate(
        "(box, data) => box.dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true}))",
        pasted,
    )
    expect(chat.page.locator("#attachments img")).to_have_count(3)
    chat.page.get_by_role("button", name="Remove image 1").click()
    expect(chat.page.locator("#attachments img")).to_have_count(2)

    chat.send("Two images")
    chat.wait_for_answer(0)
    [message] = api.last_messages()
    assert [part["type"] for part in message["content"]] == ["image_url", "image_url", "text"]
    assert message["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    expect(chat.user_messages.first.locator("img")).to_have_count(2)
    expect(chat.page.locator("#attachments img")).to_have_count(0)


def test_enter_sends_and_shift_enter_starts_a_new_line(chat, api):
    chat.prompt.type("first line")
    chat.prompt.press("Shift+Enter")
    chat.prompt.type("second line")
    assert api.requests == []
    chat.prompt.press("Enter")
    chat.wait_for_answer(0)
    assert api.last_messages() == [
        {"role": "user", "content": [{"type": "text", "text": "first line\nsecond line"}]}
    ]
    expect(chat.prompt).to_have_value("")


def test_answer_renders_markdown_and_shows_usage(chat):
    chat.send("hi")
    answer = chat.wait_for_answer(0)
    expect(answer.locator(".markdown strong")).to_have_text("world")
    expect(answer.locator("[data-stat=prompt]")).to_have_text("40 prompt")
    expect(answer.locator("[data-stat=cache]")).to_have_text("cache 75%")


def test_history_and_settings_go_into_the_request(chat, api):
    chat.set_settings(temperature=0.5, max_tokens=7, system_prompt="Be terse.", api_key="sk-test")
    chat.send("one")
    chat.wait_for_answer(0)
    chat.send("two")
    chat.wait_for_answer(1)

    request = api.requests[-1]
    assert request["headers"]["authorization"] == "Bearer sk-test"
    assert request["body"]["model"] == MODEL
    assert request["body"]["temperature"] == 0.5
    assert request["body"]["max_tokens"] == 7
    assert request["body"]["stream"] is True
    assert request["body"]["stream_options"] == {"include_usage": True}
    assert api.last_messages() == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {"role": "assistant", "content": "Hello **world**"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
    ]

    chat.page.reload()
    chat.page.get_by_role("button", name="Settings").click()
    expect(chat.page.get_by_label("Max tokens")).to_have_value("7")
    expect(chat.page.get_by_label("System prompt")).to_have_value("Be terse.")


def test_edit_and_resend_drops_what_came_after(chat, api):
    chat.send("first question")
    chat.wait_for_answer(0)
    chat.send("second question")
    chat.wait_for_answer(1)

    chat.user_messages.first.get_by_role("button", name="Edit and resend this message").click()
    chat.page.get_by_role("textbox", name="Edit your message").fill("better question")
    chat.page.get_by_role("button", name="Save and send").click()

    chat.wait_for_answer(0)
    expect(chat.user_messages).to_have_count(1)
    expect(chat.user_messages.first).to_contain_text("better question")
    assert api.last_messages() == [{"role": "user", "content": [{"type": "text", "text": "better question"}]}]


def test_regenerate_replaces_the_last_answer(chat, api):
    chat.send("question")
    chat.wait_for_answer(0)
    api.deltas = ["Another", " answer"]
    chat.answers.first.get_by_role("button", name="Regenerate this answer").click()
    expect(chat.answers.first.locator(".markdown")).to_have_text("Another answer")
    expect(chat.answers).to_have_count(1)
    assert len(api.requests) == 2 and api.requests[0]["body"] == api.requests[1]["body"]


def test_error_frame_mid_stream_keeps_the_text_and_shows_the_message(chat, api):
    api.error_mid_stream, api.error = True, "the engine is not running"
    chat.send("question")
    answer = chat.wait_for_answer(0)
    expect(answer.locator(".markdown")).to_have_text("Hello world")
    expect(answer.locator(".error")).to_have_text("Error: the engine is not running")

    api.error_mid_stream = False
    chat.send("again")
    chat.wait_for_answer(1)
    assert [m["role"] for m in api.last_messages()] == ["user", "user"]  # the failed answer is left out


def test_failed_model_list_shows_a_notice_and_the_page_still_works(page, api):
    api.models_status = 401
    chat = ChatPage(page, OFFLINE_URL).open()
    expect(chat.notice).to_contain_text("Could not list the models: missing or invalid API key")
    chat.send("still here")
    chat.wait_for_answer(0)
    assert "model" not in api.requests[-1]["body"]  # the server's default model then


def test_full_storage_shows_a_notice_and_keeps_the_conversation(page, api):
    page.add_init_script(
        """IDBObjectStore.prototype.put = function () {
            throw new DOMException("the disk is full", "QuotaExceededError");
        };"""
    )
    chat = ChatPage(page, OFFLINE_URL).open()
    chat.send("question")
    expect(chat.notice).to_contain_text("Browser storage is full")
    expect(chat.wait_for_answer(0).locator(".markdown")).to_have_text("Hello world")


def test_conversations_new_switch_rename_delete(chat):
    chat.send("alpha")
    chat.wait_for_answer(0)
    chat.page.get_by_role("button", name="New chat").click()
    expect(chat.thread).to_contain_text("Attach an image")
    chat.send("beta")
    chat.wait_for_answer(0)
    expect(chat.conversations.locator(".open")).to_have_text(["beta", "alpha"])

    chat.page.get_by_role("button", name="alpha", exact=True).click()
    expect(chat.user_messages.locator(".text")).to_have_text(["alpha"])
    chat.page.get_by_role("button", name="Rename alpha").click()
    chat.page.get_by_role("textbox", name="New title").fill("first")
    chat.page.keyboard.press("Enter")
    expect(chat.page.locator("#chat-title")).to_have_text("first")

    chat.page.once("dialog", lambda dialog: dialog.accept())
    chat.page.get_by_role("button", name="Delete beta").click()
    chat.wait_until_stored("first")
    chat.page.reload()
    expect(chat.conversations).to_have_count(1)
    expect(chat.page.get_by_role("button", name="first", exact=True)).to_have_attribute(
        "aria-current", "true"
    )


def test_theme_toggle_overrides_the_system_preference_and_persists(chat):
    chat.page.emulate_media(color_scheme="light")
    background = "getComputedStyle(document.body).backgroundColor"
    light = chat.page.evaluate(background)
    chat.page.get_by_role("button", name="Switch to dark theme").click()
    dark = chat.page.evaluate(background)
    assert dark != light
    chat.page.reload()
    expect(chat.page.get_by_role("button", name="Switch to light theme")).to_be_visible()
    assert chat.page.evaluate(background) == dark


def test_speed_is_the_servers_token_timing_even_when_the_answer_arrives_at_once(chat, api):
    """The whole stream arrives in one read: 4 tokens, 3 after the first, 0.25 s apart on the
    server, are 12 tok/s, not the thousands the page's own clock would say."""
    api.deltas = ["one", " two", " three", " four"]
    chat.send("count")
    expect(chat.wait_for_answer(0).locator("[data-stat=speed]")).to_have_text("12.0 tok/s")


def test_a_file_that_is_not_an_image_is_refused_before_sending(chat, api, tmp_path):
    fake = tmp_path / "notes.png"
    fake.write_text("these are notes, not a picture")
    chat.page.locator("#file-input").set_input_files(fake)
    expect(chat.notice).to_contain_text("notes.png is not an image")
    expect(chat.page.locator("#attachments img")).to_have_count(0)
    chat.send("anything")
    chat.wait_for_answer(0)
    assert api.last_messages() == [{"role": "user", "content": [{"type": "text", "text": "anything"}]}]


def test_an_invalid_api_key_points_to_settings_and_the_notice_goes_once_a_key_works(page, api):
    api.models_status = 401
    chat = ChatPage(page, OFFLINE_URL).open()
    expect(chat.notice).to_contain_text("enter it in Settings")
    api.models_status = 200
    chat.set_settings(api_key="sk-right")
    expect(chat.notice).to_be_hidden()


def test_the_empty_page_offers_sample_pictures_and_questions_that_send_in_one_click(chat, api):
    samples = chat.thread.locator(".sample img")
    expect(samples).to_have_count(2)
    expect(samples.first).to_have_js_property("complete", True)
    assert samples.first.evaluate("img => img.naturalWidth") == 640
    chat.page.get_by_role("button", name="What colour is the circle?").click()
    chat.wait_for_answer(0)
    [message] = api.last_messages()
    assert message["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert message["content"][1] == {"type": "text", "text": "What colour is the circle?"}


def test_sampling_is_shown_and_greedy_is_one_click(chat, api):
    summary = chat.page.locator("#sampling-summary")
    expect(summary).to_contain_text("Sampling at the model's default temperature")
    chat.page.get_by_role("checkbox", name="Greedy").check()
    expect(summary).to_contain_text("Greedy (temperature 0)")
    chat.send("q")
    answer = chat.wait_for_answer(0)
    assert api.requests[-1]["body"]["temperature"] == 0
    expect(answer.locator("[data-stat=sampling]")).to_have_text("greedy")
    chat.page.get_by_role("checkbox", name="Greedy").uncheck()
    chat.send("q2")
    chat.wait_for_answer(1)
    assert "temperature" not in api.requests[-1]["body"]
