"""The chat page uploads each image once (POST /v1/files) and refers to it by id afterwards,
against a real `mmserve serve` on the tiny random-weight Qwen2-VL.

What the page sent is read off the wire (ApiTraffic); its answers are compared with the API's
greedy answers to the same conversation sent the old way, every image as a data URL each turn.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from api_reference import MAX_TOKENS, SERVER_ARGS, api_answers, user_turn
from chat_page import ApiTraffic, ChatPage, stored_file_ids
from playwright.sync_api import expect

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


def open_chat(page, server) -> tuple[ChatPage, ApiTraffic]:
    chat = ChatPage(page, server.url + "/").open()
    chat.set_settings(temperature=0, max_tokens=MAX_TOKENS)
    return chat, ApiTraffic(page)


def ask(chat: ChatPage, turn: int, text: str, *image_paths) -> str:
    """Send one turn and return its finished answer's HTML."""
    if image_paths:
        chat.attach(*image_paths)
    chat.send(text)
    answer = chat.wait_for_answer(turn)
    expect(answer.locator(".error")).to_have_count(0)
    return answer.locator(".markdown").inner_html()


def file_ids(messages: list[dict]) -> list[str]:
    """The file ids a request's messages refer to, in order."""
    return [
        part["image_file"]["file_id"]
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] == "image_file"
    ]


def test_three_turns_send_the_image_bytes_once(page, server, image_paths):
    chat, traffic = open_chat(page, server)
    turns = [("What is in this picture?", (image_paths[0],)), ("Describe it again.", ()), ("Once more.", ())]
    expected = api_answers(server, turns)

    shown = [ask(chat, turn, text, *paths) for turn, (text, paths) in enumerate(turns)]

    assert shown == [chat.render_markdown(answer) for answer in expected]
    assert traffic.uploads() == 1
    bodies = traffic.chat_bodies()
    assert len(bodies) == 3
    [file_id] = file_ids(json.loads(bodies[0])["messages"])
    for body in bodies:
        assert b"data:" not in body and file_ids(json.loads(body)["messages"]) == [file_id]
    assert all(len(body) < 2048 for body in bodies[1:]), [len(body) for body in bodies]
    assert httpx.get(f"{server.url}/v1/files/{file_id}/content").content == image_paths[0].read_bytes()
    expect(chat.user_messages.first.locator("img")).to_have_js_property("naturalWidth", 224)


def test_a_server_without_a_files_api_gets_data_urls_and_is_asked_once(page, server, image_paths):
    chat, traffic = open_chat(page, server)
    not_found = {"detail": "Not Found"}  # what a server without the route answers
    page.route(server.url + "/v1/files", lambda route: route.fulfill(status=404, json=not_found))
    turns = [("What is in this picture?", (image_paths[0],)), ("And this one?", (image_paths[1],))]
    expected = api_answers(server, turns)

    shown = [ask(chat, turn, text, *paths) for turn, (text, paths) in enumerate(turns)]

    assert shown == [chat.render_markdown(answer) for answer in expected]
    assert traffic.uploads() == 1  # the second image is not offered to the missing API
    [_, second] = traffic.chat_messages()
    first_turn, second_turn = (user_turn(text, *paths) for text, paths in turns)
    assert second == [first_turn, {"role": "assistant", "content": expected[0]}, second_turn]
    expect(chat.notice).to_be_hidden()


def test_a_file_the_server_lost_is_uploaded_again_and_the_turn_retried(page, server, image_paths):
    chat, traffic = open_chat(page, server)
    turns = [("What is in this picture?", (image_paths[1],)), ("Describe it again.", ())]
    expected = api_answers(server, turns)
    ask(chat, 0, turns[0][0], *turns[0][1])
    [old_id] = file_ids(traffic.chat_messages()[0])
    httpx.delete(f"{server.url}/v1/files/{old_id}").raise_for_status()

    assert ask(chat, 1, turns[1][0]) == chat.render_markdown(expected[1])

    assert traffic.uploads() == 2
    _, refused, retried = traffic.chat_messages()
    assert file_ids(refused) == [old_id]
    [new_id] = file_ids(retried)
    assert new_id != old_id
    assert httpx.get(f"{server.url}/v1/files/{new_id}/content").content == image_paths[1].read_bytes()
    assert stored_file_ids(chat.wait_until_stored_messages(4)) == [new_id]


@pytest.mark.slow  # three server starts
def test_a_saved_conversation_survives_restarts_with_and_without_its_files(page, tmp_path, image_paths):
    """Same --files-dir: the saved id still works, nothing is uploaded again. A server restarted
    on an empty folder: the page uploads the image again from its saved copy and carries on."""

    starts = itertools.count(1)

    def start(files_dir, port=None) -> ServerProcess:
        args = (*SERVER_ARGS, "--files-dir", str(files_dir))
        log_path = tmp_path / f"server-{next(starts)}.log"
        proc = ServerProcess(checkpoint("qwen2_vl"), *args, log_path=log_path, port=port)
        proc.wait_healthy()
        return proc

    turns = [("What is in this picture?", (image_paths[0],)), ("Describe it again.", ()), ("Once more.", ())]
    server = start(tmp_path / "files")
    try:
        expected = api_answers(server, turns)
        chat, traffic = open_chat(page, server)
        assert ask(chat, 0, turns[0][0], *turns[0][1]) == chat.render_markdown(expected[0])
        [first_id] = stored_file_ids(chat.wait_until_stored_messages(2))

        server.stop()
        server = start(tmp_path / "files", port=server.port)
        chat.page.reload()
        expect(chat.user_messages).to_have_count(1)
        assert ask(chat, 1, turns[1][0]) == chat.render_markdown(expected[1])
        assert traffic.uploads() == 1 and file_ids(traffic.chat_messages()[-1]) == [first_id]
        assert stored_file_ids(chat.wait_until_stored_messages(4)) == [first_id]

        server.stop()
        server = start(tmp_path / "empty", port=server.port)
        chat.page.reload()
        expect(chat.user_messages).to_have_count(2)
        expect(chat.user_messages.first.locator("img")).to_have_js_property("naturalWidth", 224)
        assert ask(chat, 2, turns[2][0]) == chat.render_markdown(expected[2])
        assert traffic.uploads() == 2
        [second_id] = stored_file_ids(chat.wait_until_stored_messages(6))
        assert second_id != first_id and file_ids(traffic.chat_messages()[-1]) == [second_id]
        assert httpx.get(f"{server.url}/v1/files/{second_id}/content").content == image_paths[0].read_bytes()
    finally:
        server.stop()
