"""Overload on the hardened server (4 sequences, 24 KV blocks, at most 8 waiting): requests
queue, preemption happens and changes no token, and a burst beyond the waiting cap is turned
away with 503 instead of queueing without bound. Odd-but-valid requests never hurt the engine."""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import httpx
from reliability_util import (
    KV_BLOCKS,
    MAX_NUM_SEQS,
    MAX_WAITING,
    assert_openai_error,
    assert_still_serving,
    engine_pid,
    idle_gauges,
    metric,
    wait_for,
)

from mmserve.testing.reference import png_bytes, synthetic_image

CHAT = "/v1/chat/completions"
TOPICS = ["rivers", "mountains", "harbours", "deserts", "glaciers", "forests", "islands", "canyons"]


def _conversation(i: int) -> list[dict]:
    # ~60 prompt tokens, distinct from the first word on (so no prefix is shared)
    text = f"{TOPICS[i]} " + " ".join(f"{TOPICS[i]}-{k}" for k in range(18)) + ". Describe them."
    return [{"role": "user", "content": text}]


async def _post_all(url: str, headers: dict, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300, headers=headers, limits=httpx.Limits(max_connections=200)) as c:
        return await asyncio.gather(*(c.post(url + CHAT, json=b) for b in bodies))


def test_more_requests_than_sequences_and_kv_preempt_and_still_match_greedy(hardened, greedy):
    conversations = [_conversation(i) for i in range(2 * MAX_NUM_SEQS)]
    # ~160 tokens (10 blocks) each: any 3 running at once need 30 blocks of the 24, and a request
    # decodes for 100 steps, so the 8 overlap however fast a step is (at 40 tokens, 4 had to
    # overlap, and once the layers were fused some runs finished them before the 4th started)
    max_tokens = 100
    want = greedy(conversations, max_tokens, ignore_eos=True)
    preemptions_before = metric(hardened.url, "mmserve:num_preemptions_total")
    bodies = [
        {"messages": c, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for c in conversations
    ]
    responses = asyncio.run(_post_all(hardened.url, hardened.headers, bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text[:200] for r in responses]
    got = [r.json()["choices"][0]["message"]["content"] for r in responses]
    assert got == want
    assert all(r.json()["usage"]["completion_tokens"] == max_tokens for r in responses)
    assert metric(hardened.url, "mmserve:num_preemptions_total") > preemptions_before
    assert wait_for(lambda: set(idle_gauges(hardened.url).values()) == {0.0}, 10), idle_gauges(hardened.url)


def test_a_burst_beyond_the_waiting_cap_gets_503_and_the_queue_stays_bounded(hardened, valid_answer):
    """40 at once against 4 running + 8 waiting. Before the fix the cap read EngineCore's
    waiting count from the last step, which a burst outruns: all 40 were queued (36 waiting)."""
    waiting_seen: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            waiting_seen.append(metric(hardened.url, "mmserve:num_requests_waiting"))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    bodies = [
        {"messages": [{"role": "user", "content": f"burst {i}"}], "max_tokens": 16, "ignore_eos": True}
        for i in range(40)
    ]
    try:
        responses = asyncio.run(_post_all(hardened.url, hardened.headers, bodies))
    finally:
        stop.set()
        sampler.join()
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    refused = [r for r in responses if r.status_code == 503]
    assert refused, statuses  # (how many depends on how many finish during the burst)
    for r in refused:
        assert assert_openai_error(r, 503, "overloaded")["type"] == "service_unavailable"
    assert max(waiting_seen) <= MAX_WAITING, max(waiting_seen)
    assert_still_serving(hardened, valid_answer)


def _image_part(seed: int) -> dict:
    data = png_bytes(synthetic_image(48 + seed, 40, seed))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


ODD = [
    {"top_k": 2**62, "temperature": 1.0},
    {"seed": 2**64 - 1, "temperature": 1.0},
    {"seed": -(2**63), "temperature": 0.7},
    {"logprobs": True, "top_logprobs": 20, "n": 8, "temperature": 1.0},
    {"temperature": 1.1e-5},  # just above greedy: logits / 1e-5
    {"temperature": 1e300},
    {"repetition_penalty": 1e-300, "temperature": 1.0},
    {"repetition_penalty": 1e300, "temperature": 1.0},
    {"top_p": 1e-300, "temperature": 1.0},
    {"min_p": 1.0, "temperature": 1.0},
    {"presence_penalty": -2, "frequency_penalty": 2, "temperature": 1.0},
    {"min_tokens": 3, "max_tokens": 3, "stop_token_ids": list(range(12000, 12022))},
    {"stop": [f"s{i}" for i in range(5000)]},
    {"stop_token_ids": [12021]},  # in the vocabulary (ids past it are a 400), seldom produced
    {"n": 128, "max_tokens": 1, "temperature": 1.0},
    {"priority": -(2**63)},
    {"chat_template_kwargs": {"raise_exception": 1, "tools": None, "add_generation_prompt": False}},
]


def test_odd_but_valid_requests_never_hurt_the_engine(hardened, valid_answer):
    """Each is accepted by the frontend and runs; none may kill or restart EngineCore, and a
    plain greedy request afterwards still returns the exact offline answer."""
    pid = engine_pid(hardened.server)
    content = [_image_part(i) for i in range(8)] + [{"type": "text", "text": "Compare."}]
    requests = [{"messages": [{"role": "user", "content": content}], "max_tokens": 2}]
    for extra in ODD:
        requests.append({"messages": [{"role": "user", "content": "odd"}], "max_tokens": 2, **extra})
    for start in range(0, len(requests), MAX_NUM_SEQS):
        batch = requests[start : start + MAX_NUM_SEQS]
        responses = asyncio.run(_post_all(hardened.url, hardened.headers, batch))
        for body, r in zip(batch, responses):
            assert r.status_code == 200, (body.keys(), r.text[:300])
            assert r.json()["choices"], r.text[:300]
    assert engine_pid(hardened.server) == pid
    assert hardened.server.proc.poll() is None
    assert_still_serving(hardened, valid_answer)
    assert wait_for(lambda: set(idle_gauges(hardened.url).values()) == {0.0}, 30), idle_gauges(hardened.url)


def test_a_request_that_outgrows_the_kv_cache_while_decoding_fails_alone(hardened, greedy, valid_answer):
    """Its prompt fits the 24 blocks but prompt + answer cannot: it ends with an error (not a
    hang, and max_tokens may be as large as 2**62); a request running beside it is unaffected."""
    long_prompt = [{"role": "user", "content": "tell " * (KV_BLOCKS * 16 - 80)}]
    bodies = [
        {"messages": long_prompt, "max_tokens": 2**62, "ignore_eos": True, "temperature": 0},
        {"messages": _conversation(0), "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    ]
    doomed, neighbour = asyncio.run(_post_all(hardened.url, hardened.headers, bodies))
    assert doomed.status_code == 400, doomed.text[:300]
    assert_openai_error(doomed, 400, "")
    assert neighbour.status_code == 200
    assert neighbour.json()["choices"][0]["message"]["content"] == greedy([_conversation(0)], 8, True)[0]
    assert_still_serving(hardened, valid_answer)


def test_huge_prompts_do_not_stall_other_clients(hardened, valid_answer):
    """Four ~900 KB prompts, each far over the context. Tokenising holds the GIL (~1.5 s for
    900 KB here), so before the fix each stalled every other client, streams included; now a
    text longer than context × the longest token's characters is refused without tokenising."""
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                start = time.monotonic()
                client.get(hardened.url + "/health")
                latencies.append(time.monotonic() - start)
                time.sleep(0.01)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    huge = {"messages": [{"role": "user", "content": "word " * 180_000}], "max_tokens": 1}
    try:
        responses = asyncio.run(_post_all(hardened.url, hardened.headers, [huge] * 4))
    finally:
        stop.set()
        prober.join()
    assert all(r.status_code == 400 for r in responses)
    assert max(latencies) < 1.0, f"/health stalled for {max(latencies):.2f} s"
    assert_still_serving(hardened, valid_answer)
