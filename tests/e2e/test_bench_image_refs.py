"""`mmserve bench serve --multi-turn --image-refs file` against a real server: each conversation's
image is uploaded once to /v1/files and later turns refer to it by id, so their request bodies
stay small; with data URLs (what chat UIs send) every turn carries the image again."""

from __future__ import annotations

import argparse

import httpx
import pytest

from mmserve.bench import dataset, serve
from mmserve.bench.client import Endpoint

pytest.importorskip("datasets")
NUM_CONVERSATIONS = 3


@pytest.fixture(scope="module")
def conversations_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("visionarena")
    dataset.write_dataset(out, 8, seed=5)
    return out


def run(server, folder, *flags: str) -> dict:
    parser = argparse.ArgumentParser()
    serve.add_bench_serve_arguments(parser)
    workload = ["--multi-turn", "--num-prompts", str(NUM_CONVERSATIONS), "--output-len", "2"]
    args = parser.parse_args(
        ["--dataset-path", str(folder), *workload, "--max-concurrency", "1", "--quiet", *flags]
    )
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    loaded = dataset.load_conversations(str(folder), "train")
    return serve.benchmark(args, Endpoint(server.url, model), loaded)["runs"][0]


def file_ids(server) -> set[str]:
    return {f["id"] for f in httpx.get(server.url + "/v1/files").json()["data"]}


def test_file_references_upload_each_image_once_and_keep_later_turns_small(server, conversations_folder):
    before = file_ids(server)
    by_url = run(server, conversations_folder)
    by_file = run(server, conversations_folder, "--image-refs", "file")
    assert by_url["failed"] == 0 and by_file["failed"] == 0
    uploaded = file_ids(server) - before
    assert len(uploaded) == NUM_CONVERSATIONS  # one image per VisionArena conversation, sent once
    later_turns = [t for t in by_file["request_bytes_by_turn"] if int(t) >= 2]
    assert later_turns, "the sampled conversations should have more than one turn"
    for turn in later_turns:
        assert by_file["request_bytes_by_turn"][turn] <= 2048
        assert by_url["request_bytes_by_turn"][turn] > 10 * by_file["request_bytes_by_turn"][turn]
    assert set(by_file["ttft_by_turn"]) == set(by_url["ttft_by_turn"])


def test_file_references_without_multi_turn_are_refused(conversations_folder, capsys):
    parser = argparse.ArgumentParser()
    serve.add_bench_serve_arguments(parser)
    args = parser.parse_args(["--dataset-path", str(conversations_folder), "--image-refs", "file"])
    assert serve.run_bench_serve(args) == 2
    assert "--image-refs file needs --multi-turn" in capsys.readouterr().err
