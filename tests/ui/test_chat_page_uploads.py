"""The chat page's uploads (POST /v1/files) against a scripted API: what it sends, and what it
does when the server has no Files API or refuses a file. The real server: test_chat_page_files.py."""

from __future__ import annotations

import pytest
from api_reference import data_url
from chat_page import OFFLINE_URL, ChatPage, stored_file_ids
from fake_api import FakeApi
from playwright.sync_api import expect


@pytest.fixture
def api(page) -> FakeApi:
    return FakeApi().serve(page)


@pytest.fixture
def chat(page, api) -> ChatPage:
    return ChatPage(page, OFFLINE_URL).open()


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of a request's messages, in order."""
    contents = [message["content"] for message in messages if isinstance(message["content"], list)]
    return [part for content in contents for part in content if part["type"] != "text"]


def test_an_image_is_uploaded_once_with_the_key_and_sent_by_id(chat, api, image_paths):
    api.files_status = 200
    chat.set_settings(api_key="sk-test")
    chat.attach(image_paths[0])
    chat.send("one")
    chat.wait_for_answer(0)
    chat.send("two")
    chat.wait_for_answer(1)

    [upload] = api.uploads
    assert upload["headers"]["authorization"] == "Bearer sk-test"
    assert upload["headers"]["content-type"].startswith("multipart/form-data; boundary=")
    assert b'name="purpose"\r\n\r\nvision\r\n' in upload["body"]
    assert b'filename="picture-1.png"' in upload["body"] and image_paths[0].read_bytes() in upload["body"]
    by_id = {"type": "image_file", "image_file": {"file_id": api.file_id(0)}}
    assert [image_parts(r["body"]["messages"]) for r in api.requests] == [[by_id], [by_id]]


def test_a_message_sent_while_its_image_uploads_waits_for_it(chat, api, image_paths):
    api.files_status, api.held_uploads = 200, []
    with chat.page.expect_request(lambda request: request.url.endswith("/v1/files")):
        chat.page.locator("#file-input").set_input_files(image_paths[0])
    chat.send("about the picture")
    # Not sent yet (sending clears the box at once), and nothing left out of it.
    assert chat.prompt.input_value() == "about the picture" and api.requests == []

    api.release_uploads()
    chat.wait_for_answer(0)
    by_id = {"type": "image_file", "image_file": {"file_id": api.file_id(0)}}
    assert image_parts(api.last_messages()) == [by_id]
    expect(chat.page.locator("#attachments img")).to_have_count(0)


def test_without_a_files_api_images_go_as_data_urls_and_the_upload_is_tried_once(chat, api, image_paths):
    api.files_status = 405  # as a plain static file server answers a POST
    chat.attach(image_paths[0])
    chat.send("one")
    chat.wait_for_answer(0)
    chat.attach(image_paths[1])
    chat.send("two")
    chat.wait_for_answer(1)

    assert len(api.uploads) == 1
    parts = image_parts(api.last_messages())
    assert [part["type"] for part in parts] == ["image_url", "image_url"]
    assert all(part["image_url"]["url"].startswith("data:image/png;base64,") for part in parts)
    expect(chat.notice).to_be_hidden()


@pytest.mark.parametrize(
    ("status", "error"),
    [(413, "the file exceeds the 1024 byte limit"), (400, "the file is not an image that can be served")],
)
def test_an_upload_the_server_refuses_is_shown_and_not_attached(chat, api, image_paths, status, error):
    api.files_status, api.error = status, error
    chat.page.locator("#file-input").set_input_files(image_paths[0])
    expect(chat.notice).to_contain_text(
        f"picture-1.png could not be uploaded: {error} (HTTP {status}), so it was not attached."
    )
    expect(chat.page.locator("#attachments img")).to_have_count(0)

    api.files_status = 200  # the next one is taken, and the refusal did not turn uploads off
    chat.attach(image_paths[1])
    chat.send("q")
    chat.wait_for_answer(0)
    by_id = {"type": "image_file", "image_file": {"file_id": api.file_id(1)}}
    assert image_parts(api.last_messages()) == [by_id]


def test_removed_attachments_and_deleted_conversations_delete_their_files(chat, api, image_paths):
    api.files_status = 200
    chat.attach(*image_paths)
    deleting = lambda request: request.method == "DELETE"
    with chat.page.expect_request_finished(deleting):
        chat.page.get_by_role("button", name="Remove image 1").click()
    chat.send("q")
    chat.wait_for_answer(0)

    chat.page.once("dialog", lambda dialog: dialog.accept())
    with chat.page.expect_request_finished(deleting):
        chat.page.get_by_role("button", name="Delete q").click()
    expect(chat.conversations).to_have_count(0)
    assert api.deleted == [api.file_id(0), api.file_id(1)]


def test_a_conversation_saved_before_uploads_uploads_its_images_on_the_next_turn(chat, api, image_paths):
    """Saved by the page before it uploaded images: each image a bare data URL string."""
    api.files_status = 200
    legacy = [{"role": "user", "text": "old", "images": [data_url(image_paths[0])]}]
    legacy.append({"role": "assistant", "text": "an old answer"})
    chat.page.evaluate(
        """(messages) => new Promise((resolve, reject) => {
            const open = indexedDB.open("mmserve-chat");
            open.onsuccess = () => {
                const tx = open.result.transaction(["meta", "messages"], "readwrite");
                tx.objectStore("meta").put({ id: "legacy", title: "old", updated_at: Date.now() });
                tx.objectStore("messages").put({ id: "legacy", messages });
                tx.oncomplete = () => { open.result.close(); resolve(); };
                tx.onerror = () => reject(tx.error);
            };
            open.onerror = () => reject(open.error);
        })""",
        legacy,
    )
    chat.page.evaluate("localStorage.setItem('mmserve.current', 'legacy')")
    chat.page.reload()
    expect(chat.user_messages.first.locator("img")).to_have_js_property("naturalWidth", 224)

    chat.send("new")
    chat.wait_for_answer(1)
    [upload] = api.uploads
    assert image_paths[0].read_bytes() in upload["body"]
    assert image_parts(api.last_messages()) == [
        {"type": "image_file", "image_file": {"file_id": api.file_id(0)}}
    ]
    assert stored_file_ids(chat.wait_until_stored_messages(4)) == [api.file_id(0)]
