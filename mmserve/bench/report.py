"""The `vllm bench serve` text report and the JSON result, from BenchmarkMetrics."""

from __future__ import annotations

import dataclasses

from mmserve.bench.metrics import STATS, BenchmarkMetrics, Distribution

_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(label: str, value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value:<10}"


def _percentile_name(p: float) -> str:
    return f"{p:g}"


def format_report(
    m: BenchmarkMetrics,
    max_concurrency: int | None,
    request_rate: float,
    title: str = "Serving Benchmark Result",
    *,
    model: str | None = None,
    dataset: str | None = None,
) -> str:
    lines = [f"{' ' + title + ' ':=^50}"]
    if model is not None:
        lines.append(_row("Model:", model))
    if dataset is not None:
        lines.append(_row("Dataset:", dataset))
    lines += [
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", request_rate))
    lines += [
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
        _row("Peak concurrent requests:", float(m.max_concurrent_requests)),
        _row("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for stat in STATS:
        section, short = _TITLES[stat]
        lines += _distribution_lines(getattr(m, stat), section, short)
    lines.append("=" * 50)
    return "\n".join(lines)


def _distribution_lines(d: Distribution, section: str, short: str) -> list[str]:
    lines = [
        f"{section:-^50}",
        _row(f"Mean {short} (ms):", d.mean_ms),
        _row(f"Median {short} (ms):", d.median_ms),
    ]
    lines += [_row(f"P{_percentile_name(p)} {short} (ms):", v) for p, v in d.percentiles_ms.items()]
    return lines


def format_turn_report(by_turn: dict[int, Distribution]) -> str:
    """TTFT per turn index (1-based in the text) for --multi-turn."""
    lines = [f"{'TTFT by turn':-^50}"]
    for turn, d in by_turn.items():
        extra = " ".join(f"P{_percentile_name(p)} {v:.2f}" for p, v in d.percentiles_ms.items())
        lines.append(f"turn {turn + 1}: mean {d.mean_ms:.2f} ms, median {d.median_ms:.2f} ms, {extra}")
    return "\n".join(lines)


def format_bytes_report(by_turn: dict[int, float]) -> str:
    """Median request body size per turn index (1-based in the text) for --multi-turn."""
    cells = ", ".join(f"turn {turn + 1}: {size:.0f}" for turn, size in by_turn.items())
    return f"Median request bytes by turn: {cells}"


def metrics_json(m: BenchmarkMetrics) -> dict:
    """vLLM's result-file key names (mean_ttft_ms, p99_itl_ms, ...) plus our extras."""
    out = {
        "completed": m.completed,
        "failed": m.failed,
        "duration": m.duration_s,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "total_cached_tokens": m.total_cached_tokens,
        "request_throughput": m.request_throughput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for stat in STATS:
        d: Distribution = getattr(m, stat)
        out[f"mean_{stat}_ms"] = d.mean_ms
        out[f"median_{stat}_ms"] = d.median_ms
        out[f"std_{stat}_ms"] = d.std_ms
        out |= {f"p{_percentile_name(p)}_{stat}_ms": v for p, v in d.percentiles_ms.items()}
    return out


def distribution_json(d: Distribution) -> dict:
    return {k: v for k, v in dataclasses.asdict(d).items() if k != "percentiles_ms"} | {
        f"p{_percentile_name(p)}_ms": v for p, v in d.percentiles_ms.items()
    }
