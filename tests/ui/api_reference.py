"""What the API answers to the page's questions, asked directly with data URLs: the reference the
chat page's answers (greedy, the tiny random-weight Qwen2-VL) are compared with."""

from __future__ import annotations

import base64

import httpx

MAX_TOKENS = 6  # short answers keep the UI tests fast on a CPU
# A small KV cache (2048 blocks, plenty here) starts in seconds instead of half a minute.
SERVER_ARGS = ("--preprocess-workers", "1", "--kv-cache-memory", "64MiB")


def data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def user_turn(text: str, *image_paths) -> dict:
    images = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in image_paths]
    return {"role": "user", "content": [*images, {"type": "text", "text": text}]}


def api_answer(server, messages: list[dict]) -> str:
    """The answer the API gives for the same request as the page's (greedy, same max_tokens)."""
    body = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def api_answers(server, turns: list[tuple[str, tuple]]) -> list[str]:
    """The answers of a conversation of (text, image paths) turns, each turn asked with the
    earlier turns and their answers, every image resent as a data URL (as the page did before
    it uploaded images)."""
    messages, answers = [], []
    for text, image_paths in turns:
        messages.append(user_turn(text, *image_paths))
        answers.append(api_answer(server, messages))
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers
