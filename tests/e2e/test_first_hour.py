"""A vLLM user's first hour against one real `mmserve serve`, started with vLLM's flags: the
start-up explains itself in one block, the flags take effect, /version and /metrics answer as
vLLM's do, and Ctrl+C stops it cleanly."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmserve import __version__
from mmserve.frontend.tokenizer import Tokenizer
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.server import ServerProcess, descendants

SERVER_ARGS = ("--preprocess-workers", "1", "--max-num-batched-tokens", "64", "--kv-cache-memory", "64MiB")

NAMES = ("first", "second")
# vLLM's metric families (as the parser names them: counters without `_total`)
VLLM_FAMILIES = {
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "num_preemptions": "counter",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "request_success": "counter",
    "mm_cache_queries": "counter",
    "mm_cache_hits": "counter",
    "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram",
    "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram",
}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    """The folder's own template behind a marker, so its effect shows in the prompt."""
    source = Tokenizer(checkpoint("qwen2_vl"))._template_source
    path = tmp_path_factory.mktemp("template") / "marked.jinja"
    path.write_text("MARKED " + source)
    return path


@pytest.fixture(scope="module")
def server(template_file, tmp_path_factory):
    flags = (
        *("--served-model-name", *NAMES),
        *("--chat-template", str(template_file)),
        *("-tp", "1", "--trust-remote-code", "--enforce-eager", "--disable-log-requests"),
        *("--uvicorn-log-level", "warning"),
    )
    log_path = tmp_path_factory.mktemp("server") / "log"
    proc = ServerProcess(checkpoint("qwen2_vl"), *SERVER_ARGS, *flags, log_path=log_path)
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


def full_log(server: ServerProcess) -> str:
    return server.log_path.read_text(errors="replace")


def test_start_up_ends_with_one_block_that_says_what_how_and_where(server):
    log = full_log(server)
    block = "\n".join(log[log.index("mmserve is ready") :].splitlines()[:14])
    url = re.escape(f"http://127.0.0.1:{server.port}")
    for row in (
        r"model\s+/\S+ \(\w+\), served as 'first', 'second'",
        r"dtype\s+float32",
        r"device\s+cpu, 1 threads",
        r"attention\s+(cpu|torch)",
        r"KV cache\s+\d+ blocks x 16 tokens = \d+ tokens; max concurrency \d+\.\d\d requests",
        r"preprocess\s+1 worker processes",
        rf"API\s+{url}/v1",
        rf"chat page\s+{url}/\n",
        rf"dashboard\s+{url}/dashboard",
    ):
        assert re.search(row, block), (row, block)
    # progress before it, in order
    steps = ("loaded the weights in", "allocated the KV cache", "mmserve is ready")
    positions = [log.index(step) for step in steps]
    assert positions == sorted(positions)


def test_flags_that_change_nothing_said_so_once_each(server):
    log = full_log(server)
    for flag in ("--trust-remote-code", "--disable-log-requests"):
        assert log.count(f"{flag} is accepted and changes nothing") == 1


def test_uvicorn_log_level_quiets_the_http_servers_own_lines(server):
    log = full_log(server)
    assert "Uvicorn running on" not in log and "Application startup complete" not in log


def test_every_served_name_is_listed_and_answers_under_the_first(server):
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [card["id"] for card in models] == list(NAMES)
    body = {"model": "second", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "first"
    unknown = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": "third"}, timeout=60)
    assert unknown.status_code == 404 and "'first' or 'second'" in unknown.json()["error"]["message"]


def test_the_chat_template_flag_renders_the_prompt(server):
    messages = [{"role": "user", "content": "hi"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert prompt.startswith("MARKED")


def test_version_route(server):
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_metrics_have_vllms_names_and_labels_and_no_created_series(server):
    body = {
        "messages": [{"role": "user", "content": "Count to ten."}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        response.read()
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    assert not [name for name in families if name.endswith("_created")]
    assert not [s.name for f in families.values() for s in f.samples if s.name.endswith("_created")]
    for name, kind in VLLM_FAMILIES.items():
        family = families.get(f"mmserve:{name}")
        assert family is not None, f"mmserve:{name} missing"
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            assert sample.labels["model_name"] == "first" and sample.labels["engine"] == "0", sample
    by_reason = {s.labels["finished_reason"]: s.value for s in families["mmserve:request_success"].samples}
    assert set(by_reason) == {"stop", "length", "abort", "error"}
    assert by_reason["length"] >= 1
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        count = next(s for s in families[f"mmserve:{name}"].samples if s.name.endswith("_count"))
        assert count.value >= 1, name


def test_ctrl_c_stops_the_server_with_status_0_and_no_traceback(server):
    """Last in this module: it stops the shared server. Ctrl+C in a terminal signals the whole
    process group: the server, EngineCore and the preprocess workers."""
    for pid in (server.proc.pid, *descendants(server.proc.pid)):
        os.kill(pid, signal.SIGINT)
    assert server.proc.wait(30) == 0
    log = full_log(server)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert "mmserve: stopped" in log
