"""side_by_side's bookkeeping: the round-robin schedule of --interleave and its within-round
ratios (the servers themselves are stand-ins here; the e2e benchmarks start real ones)."""

from __future__ import annotations

import pytest

from mmserve.bench import side_by_side
from mmserve.bench.peers import Peer


def result(rate: float) -> dict:
    run = {
        "request_throughput": rate,
        "output_throughput": 32 * rate,
        "mean_ttft_ms": 1.0,
        "median_ttft_ms": 1.0,
        "p99_ttft_ms": 2.0,
        "median_tpot_ms": 1.0,
        "p99_tpot_ms": 1.0,
        "median_itl_ms": 1.0,
        "median_e2el_ms": 1.0,
        "p99_e2el_ms": 1.0,
        "failed": 0,
        "loadavg_1min_before": 0.5,
    }
    return {"num_prompts": 4, "runs": [run], "server_cpu_ms_per_request": {"mmserve-engine": 10.0}}


def test_within_round_ratios_are_medians_of_same_round_ratios():
    a = {"rounds_req_per_s": [10.0, 20.0, 30.0]}
    b = {"rounds_req_per_s": [5.0, 20.0, 10.0]}  # a ÷ b by round: 2, 1, 3
    ratios = side_by_side.within_round_ratios([a, b])
    assert ratios[0] == [1.0, 2.0]
    assert ratios[1][0] == pytest.approx(0.5)  # b ÷ a by round: 0.5, 1, 1/3


@pytest.mark.parametrize("interleave", [False, True])
def test_rounds_go_round_robin_only_when_interleaved(interleave, monkeypatch, tmp_path):
    rates = {"fast": [30.0, 10.0, 20.0], "slow": [10.0, 5.0, 20.0]}
    calls = []

    def fake_rounds(peer: Peer, args, dataset, indices):
        calls.append((peer.name, indices))
        return [result(rates[peer.name][i]) for i in indices], {"encoder_runs": float(len(indices))}

    monkeypatch.setattr(side_by_side, "run_rounds", fake_rounds)
    monkeypatch.setattr(side_by_side, "load_conversations", lambda path, split: [])
    markdown = tmp_path / "table.md"
    argv = ["model", "--dataset-path", "data", "--rounds", "3", "--markdown", str(markdown)]
    argv += ["--peer", "fast=mmserve", "--peer", "slow=mmserve"] + (["--interleave"] if interleave else [])
    assert side_by_side.main(argv) == 0
    if interleave:
        assert calls == [(name, [i]) for i in range(3) for name in ("fast", "slow")]
    else:
        assert calls == [("fast", [0, 1, 2]), ("slow", [0, 1, 2])]
    text = markdown.read_text()
    # fast ÷ slow: 3, 2, 1 by round (median 2); the median rounds alone: 20 ÷ 10 = 2 as well.
    assert "| fast | 1.00 | 2.00 |" in text
    assert ("round 3" in text) is interleave
    assert "| encoder_runs |" in text and "| fast | 3 |" in text  # counters summed over the servers
