"""One streamed chat completion against an OpenAI-compatible server, timed like vLLM's client.

The body is vLLM's `openai-chat` backend's: temperature 0, `max_completion_tokens`, streaming with
`include_usage`, and `ignore_eos` only when asked. Every SSE event with non-empty `choices` counts
as a token arrival (the first one is TTFT); the usage event gives the token counts.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass

import httpx

from mmserve.bench.metrics import RequestResult


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    path: str = "/v1/chat/completions"
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.path


def chat_body(model: str, messages: list[dict], output_len: int, ignore_eos: bool) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "temperature": 0.0,
        "max_completion_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def upload_image(client: httpx.AsyncClient, endpoint: Endpoint, data_url: str) -> str:
    """Upload a data-URL image to the server's /v1/files (purpose "vision"); its file id.
    Raises httpx.HTTPStatusError when the server refuses it (or has no Files API)."""
    header, _, encoded = data_url.partition(",")
    mime = header.removeprefix("data:").split(";")[0] or "application/octet-stream"
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    response = await client.post(
        endpoint.base_url.rstrip("/") + "/v1/files",
        files={"file": ("image", base64.b64decode(encoded), mime)},
        data={"purpose": "vision"},
        headers=headers,
    )
    response.raise_for_status()
    return response.json()["id"]


async def send_chat(
    client: httpx.AsyncClient, endpoint: Endpoint, body: dict, turn: int = 0
) -> RequestResult:
    """Send one streaming request; never raises for HTTP or protocol errors (they are recorded)."""
    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    payload_bytes = json.dumps(body).encode()
    result = RequestResult(success=False, turn=turn, request_bytes=len(payload_bytes))
    chunks_with_content = 0
    text: list[str] = []
    start = time.perf_counter()
    result.start_time = start
    last = start
    try:
        async with client.stream("POST", endpoint.url, content=payload_bytes, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(payload)
                if event.get("error"):
                    result.error = str(event["error"])[:300]
                    return result
                if choices := event.get("choices"):
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    content = choices[0].get("delta", {}).get("content")
                    if content:
                        chunks_with_content += 1
                        text.append(content)
                    last = now
                if usage := event.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                    result.output_tokens = usage.get("completion_tokens") or 0
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
        result.latency_s = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.output_tokens = result.output_tokens or chunks_with_content
    result.generated_text = "".join(text)
    result.success = result.ttft_s > 0.0
    if not result.success:
        result.error = "the stream carried no choices"
    return result
