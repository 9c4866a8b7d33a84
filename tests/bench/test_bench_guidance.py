"""`mmserve bench serve` guides a first run: an unreachable dataset is one line naming the
generator, the report names the model and the dataset, and --plot-file is honoured with or
without --sweep-rates."""

from __future__ import annotations

import argparse

from mmserve.bench import serve
from mmserve.bench.client import Endpoint
from mmserve.bench.metrics import RequestResult, compute_metrics
from mmserve.bench.report import format_report, metrics_json

RESULT = RequestResult(
    True, start_time=0.0, ttft_s=0.5, itl_s=[0.1, 0.2], latency_s=0.8, prompt_tokens=10, output_tokens=3
)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_bench_serve_arguments(parser)
    return parser.parse_args(list(flags))


def test_an_unreachable_hub_dataset_points_to_the_generator(capsys):
    problem = serve.dataset_problem("lmarena-ai/VisionArena-Chat", hub_reachable=lambda: False)
    assert "benchmarks/make_visionarena_dataset.py" in problem and "--dataset-path DIR" in problem
    assert serve.dataset_problem("lmarena-ai/VisionArena-Chat", hub_reachable=lambda: True) is None


def test_a_local_dataset_needs_no_hub(tmp_path):
    assert serve.dataset_problem(str(tmp_path), hub_reachable=lambda: False) is None


def test_the_report_names_the_model_and_the_dataset():
    m = compute_metrics([RESULT], duration_s=1.0, percentiles=[50.0, 99.0])
    report = format_report(m, None, float("inf"), model="demo-model", dataset="/data/visionarena")
    lines = report.splitlines()
    assert lines[1].split() == ["Model:", "demo-model"]
    assert lines[2].split() == ["Dataset:", "/data/visionarena"]


def test_plot_file_is_written_for_a_single_rate(tmp_path, monkeypatch):
    m = compute_metrics([RESULT], duration_s=1.0, percentiles=[50.0, 99.0])
    document = {"runs": [{"request_rate": float("inf"), **metrics_json(m)}]}
    monkeypatch.setattr(
        serve, "endpoint_from_args", lambda args: Endpoint("http://x", "m", "/v1/chat/completions", None)
    )
    monkeypatch.setattr(serve, "benchmark", lambda args, endpoint: document)
    plot = tmp_path / "plot.png"
    args = parse("--dataset-path", str(tmp_path), "--plot-file", str(plot))
    assert serve.run_bench_serve(args) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
