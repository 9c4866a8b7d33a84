"""Benchmark arithmetic, with vLLM's `bench serve` definitions. Pure functions of recorded times.

Per request (all in seconds, measured by the client):
  TTFT  = first streamed chunk with choices − request sent
  ITL   = gaps between consecutive chunks with choices (one per chunk after the first)
  TPOT  = (E2EL − TTFT) / (output_tokens − 1), only for requests with more than one output token
  E2EL  = last byte of the response − request sent
Throughputs divide totals over successful requests by the benchmark's wall-clock duration.
Peak output throughput counts chunk arrivals (≈ tokens) in whole-second buckets from the first
request's start, as vLLM does; peak concurrency counts requests active in each such second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STATS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What the client recorded for one request. Times are `time.perf_counter()` seconds."""

    success: bool
    start_time: float = 0.0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    prompt_tokens: int = 0  # from the server's usage
    output_tokens: int = 0  # from the server's usage, else the number of chunks with content
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens where the server reports it
    generated_text: str = ""
    error: str = ""
    turn: int = 0  # 0-based turn index in --multi-turn mode, 0 otherwise
    request_bytes: int = 0  # size of the JSON body sent


@dataclass
class Distribution:
    """Mean, median, standard deviation and chosen percentiles of one latency, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float]

    @classmethod
    def of(cls, values_s: list[float], percentiles: list[float]) -> Distribution:
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        if ms.size == 0:
            return cls(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles})
        return cls(
            float(ms.mean()),
            float(np.median(ms)),
            float(ms.std()),
            {p: float(np.percentile(ms, p)) for p in percentiles},
        )


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # (input + output) tok/s
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution


def tpot_s(result: RequestResult) -> float | None:
    """Time per output token after the first, or None for requests with ≤ 1 output token."""
    if result.output_tokens <= 1:
        return None
    return (result.latency_s - result.ttft_s) / (result.output_tokens - 1)


def peaks(results: list[RequestResult]) -> tuple[float, int]:
    """(most chunks arriving in one whole second, most requests active in one second)."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency_s for r in ok)
    num_buckets = int(np.ceil(end - t0)) + 1
    arrivals = np.concatenate(
        [r.start_time - t0 + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)]) for r in ok]
    )
    tokens = np.bincount(arrivals.astype(np.int64), minlength=num_buckets)
    # Each request is active from the second it starts to the second it ends, inclusive.
    first = np.array([int(r.start_time - t0) for r in ok])
    last = np.array([int(r.start_time + r.latency_s - t0) for r in ok])
    active = np.cumsum(
        np.bincount(first, minlength=num_buckets + 1) - np.bincount(last + 1, minlength=num_buckets + 1)
    )
    return float(tokens.max()), int(active.max())


def compute_metrics(
    results: list[RequestResult], duration_s: float, percentiles: list[float]
) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    peak_tokens, peak_active = peaks(results)
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=sum(r.cached_tokens for r in ok),
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_active,
        ttft=Distribution.of([r.ttft_s for r in ok], percentiles),
        tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of([gap for r in ok for gap in r.itl_s], percentiles),
        e2el=Distribution.of([r.latency_s for r in ok], percentiles),
    )


def request_bytes_by_turn(results: list[RequestResult]) -> dict[int, float]:
    """Median request body size of successful requests by turn index (multi-turn mode)."""
    ok = [r for r in results if r.success]
    turns = sorted({r.turn for r in ok})
    return {t: float(np.median([r.request_bytes for r in ok if r.turn == t])) for t in turns}


def ttft_by_turn(results: list[RequestResult], percentiles: list[float]) -> dict[int, Distribution]:
    """TTFT of successful requests grouped by turn index (multi-turn mode)."""
    turns = sorted({r.turn for r in results if r.success})
    return {
        t: Distribution.of([r.ttft_s for r in results if r.success and r.turn == t], percentiles)
        for t in turns
    }
