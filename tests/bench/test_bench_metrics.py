"""The benchmark's arithmetic against a hand-computed example (vLLM's `bench serve` definitions)."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve.bench.metrics import RequestResult, compute_metrics, tpot_s, ttft_by_turn
from mmserve.bench.report import format_report, metrics_json
from mmserve.bench.runner import arrival_offsets_s

# A: sent at 0.0 s, tokens at 0.5, 0.6, 0.8, 1.1 s, done at 1.1 s, 100 prompt tokens.
# B: sent at 0.2 s, tokens at 1.2, 1.7, 1.8 s, done at 2.2 s (the usage event came later), 50 prompt tokens.
# C: failed. The run lasted 2.5 s.
A = RequestResult(
    True, start_time=0.0, ttft_s=0.5, itl_s=[0.1, 0.2, 0.3], latency_s=1.1, prompt_tokens=100, output_tokens=4
)
B = RequestResult(
    True, start_time=0.2, ttft_s=1.0, itl_s=[0.5, 0.1], latency_s=2.0, prompt_tokens=50, output_tokens=3
)
C = RequestResult(False, start_time=0.3, error="HTTP 500")
PCTS = [50.0, 99.0]


@pytest.fixture
def m():
    return compute_metrics([A, B, C], duration_s=2.5, percentiles=PCTS)


def test_counts_and_totals_cover_successful_requests_only(m):
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (150, 7)


def test_throughputs_divide_totals_by_the_run_duration(m):
    assert m.request_throughput == pytest.approx(2 / 2.5)
    assert m.output_throughput == pytest.approx(7 / 2.5)
    assert m.total_token_throughput == pytest.approx(157 / 2.5)


def test_tpot_excludes_the_first_token():
    assert tpot_s(A) == pytest.approx((1.1 - 0.5) / 3)
    assert tpot_s(B) == pytest.approx((2.0 - 1.0) / 2)
    assert tpot_s(RequestResult(True, ttft_s=0.1, latency_s=0.1, output_tokens=1)) is None


def test_latency_distributions_in_milliseconds(m):
    assert (m.ttft.mean_ms, m.ttft.median_ms) == pytest.approx((750.0, 750.0))
    assert m.ttft.percentiles_ms[99.0] == pytest.approx(500 + 0.99 * 500)
    assert (m.tpot.mean_ms, m.tpot.median_ms) == pytest.approx((350.0, 350.0))
    assert m.itl.mean_ms == pytest.approx((100 + 200 + 300 + 500 + 100) / 5)
    assert m.itl.percentiles_ms[50.0] == pytest.approx(200.0)
    assert (m.e2el.mean_ms, m.e2el.median_ms) == pytest.approx((1550.0, 1550.0))


def test_peaks_bucket_by_whole_seconds_from_the_first_start(m):
    # Tokens in second 0: A's first three; in second 1: A's last and all three of B's.
    assert m.max_output_tokens_per_s == 4.0
    # A is active in seconds 0–1, B in 0–2.
    assert m.max_concurrent_requests == 2


def test_ttft_by_turn_groups_successful_requests():
    turn2 = RequestResult(True, ttft_s=0.05, latency_s=0.1, output_tokens=2, turn=1)
    by_turn = ttft_by_turn([A, B, C, turn2], PCTS)
    assert sorted(by_turn) == [0, 1]
    assert by_turn[0].median_ms == pytest.approx(750.0)
    assert by_turn[1].mean_ms == pytest.approx(50.0)


def test_report_and_json_use_vllm_names(m):
    text = format_report(m, max_concurrency=8, request_rate=float("inf"))
    for label in ("Successful requests:", "Failed requests:", "Request throughput (req/s):", "P99 ITL (ms):"):
        assert label in text
    doc = metrics_json(m)
    assert doc["mean_ttft_ms"] == pytest.approx(750.0)
    assert doc["p99_ttft_ms"] == pytest.approx(995.0)
    assert doc["completed"] == 2


def test_no_successful_request_gives_zeros():
    m = compute_metrics([C], duration_s=1.0, percentiles=PCTS)
    assert (m.completed, m.failed, m.ttft.mean_ms, m.max_output_tokens_per_s) == (0, 1, 0.0, 0.0)


def test_arrivals_start_at_zero_and_average_one_over_rate():
    assert not arrival_offsets_s(5, float("inf"), 1.0, seed=0).any()
    offsets = arrival_offsets_s(20_001, rate=4.0, burstiness=0.5, seed=0)
    assert offsets[0] == 0.0
    assert np.all(np.diff(offsets) >= 0)
    assert offsets[-1] / 20_000 == pytest.approx(0.25, rel=0.05)
