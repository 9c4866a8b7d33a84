"""The ready block: every row a first-time user asks about, with the engine's own figures."""

from __future__ import annotations

import re

import pytest

from mmserve.config import ServerConfig
from mmserve.engine_args import EngineArgs
from mmserve.entrypoints.startup import base_url, startup_report
from mmserve.protocol import EngineReady
from mmserve.testing.checkpoints import checkpoint


@pytest.fixture(scope="module")
def engine_config():
    return EngineArgs(
        model=checkpoint("qwen2_vl"), max_model_len=1024, dtype="float32"
    ).create_engine_config()


def test_the_block_names_model_dtype_device_backend_capacity_workers_and_urls(engine_config):
    ready = EngineReady(
        num_blocks=256, device="cpu", num_threads=2, attention_backend="cpu", load_time_s=3.25
    )
    server = ServerConfig(served_model_name="demo", served_model_aliases=("alias",), port=8123)
    report = startup_report(
        engine_config,
        server,
        ready,
        engine_pid=4242,
        num_preprocess_workers=2,
        segment_prefix="mmserve_pp_x_",
        start_time_s=4.5,
    )
    lines = report.splitlines()
    assert lines[0] == "mmserve is ready"
    rows = dict(re.fullmatch(r"  (\S.*?)\s{2,}(\S.*)", line).groups() for line in lines[1:])
    assert rows["model"].endswith("served as 'demo', 'alias'")
    assert rows["dtype"] == "float32"
    assert rows["device"] == "cpu, 2 threads"
    assert rows["attention"] == "cpu"
    # 256 blocks of 16 tokens = 4096 tokens = 4 requests at max_model_len 1024
    assert rows["KV cache"] == (
        "256 blocks x 16 tokens = 4096 tokens; max concurrency 4.00 requests at max_model_len 1024"
    )
    assert rows["preprocess"] == "2 worker processes"
    assert rows["processes"] == "EngineCore pid 4242; image segments mmserve_pp_x_* in /dev/shm"
    assert rows["started in"] == "4.5 s (model and KV cache: 3.2 s)"
    assert rows["API"] == "http://127.0.0.1:8123/v1"
    assert rows["chat page"] == "http://127.0.0.1:8123/"
    assert rows["dashboard"] == "http://127.0.0.1:8123/dashboard (charts of http://127.0.0.1:8123/metrics)"


@pytest.mark.parametrize(
    "host,url",
    [("0.0.0.0", "http://127.0.0.1:80"), ("10.1.2.3", "http://10.1.2.3:80"), ("::1", "http://[::1]:80")],
)
def test_a_wildcard_host_is_shown_as_an_address_a_browser_can_open(host, url):
    assert base_url(ServerConfig(served_model_name="m", host=host, port=80)) == url
