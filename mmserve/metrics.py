"""Prometheus metrics with vLLM's names under an `mmserve:` prefix.

Engine-side numbers arrive as SchedulerStats with every step (gauges, and cumulative counts
turned into counter increments); request timings are observed by the API server.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mmserve.outputs import RequestOutput
from mmserve.protocol import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# SchedulerStats field → counter name (the stats carry running totals)
_CUMULATIVE = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "encoder_runs": "encoder_runs",
    "encoder_cache_hits": "encoder_cache_hits",
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"mmserve:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"mmserve:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"mmserve:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_blocks = gauge("kv_cache_blocks_in_use", "KV cache blocks held by requests.")
        self.encoder_refs = gauge("encoder_cache_references", "Encoder-cache entries referenced by requests.")
        self.counters = {
            "prefix_cache_queries": counter(
                "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ),
            "prefix_cache_hits": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            "num_preemptions": counter("num_preemptions", "Requests preempted (recomputed later)."),
            "encoder_runs": counter("encoder_runs", "Images run through the vision encoder."),
            "encoder_cache_hits": counter("encoder_cache_hits", "Images served from the encoder cache."),
        }
        self.mm_cache_queries = counter("mm_cache_queries", "Images looked up in the preprocessing cache.")
        self.mm_cache_hits = counter("mm_cache_hits", "Images found in the preprocessing cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.requests_finished = counter("request_success", "Finished requests.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", _LATENCY_BUCKETS
        )
        self._last_totals: dict[str, int] = dict.fromkeys(_CUMULATIVE, 0)
        self._last_mm = (0, 0)
        self._progress: dict[str, tuple[int, float]] = {}  # request id → (tokens seen, last token time)

    def update_engine(self, stats: SchedulerStats) -> None:
        self.running.labels(**self._labels).set(stats.num_running)
        self.waiting.labels(**self._labels).set(stats.num_waiting)
        self.kv_usage.labels(**self._labels).set(stats.kv_cache_usage)
        self.kv_blocks.labels(**self._labels).set(stats.kv_blocks_in_use)
        self.encoder_refs.labels(**self._labels).set(stats.encoder_cache_references)
        for field, name in _CUMULATIVE.items():
            total = getattr(stats, field)
            if total > self._last_totals[field]:
                self.counters[name].labels(**self._labels).inc(total - self._last_totals[field])
            self._last_totals[field] = total

    def update_preprocess(self, queries: int, hits: int) -> None:
        q0, h0 = self._last_mm
        if queries > q0:
            self.mm_cache_queries.labels(**self._labels).inc(queries - q0)
        if hits > h0:
            self.mm_cache_hits.labels(**self._labels).inc(hits - h0)
        self._last_mm = (queries, hits)

    def observe_request(self, delta: RequestOutput, start: float) -> None:
        """Called with each delta of a request (RequestOutputKind.DELTA) as it streams in."""
        now = time.monotonic()
        seen, last_time = self._progress.get(delta.request_id, (0, start))
        num_tokens = seen + sum(len(c.token_ids) for c in delta.outputs)
        if num_tokens > seen:
            if seen == 0:
                self.ttft.labels(**self._labels).observe(now - start)
            else:
                gap = (now - last_time) / (num_tokens - seen)
                for _ in range(num_tokens - seen):
                    self.itl.labels(**self._labels).observe(gap)
            self._progress[delta.request_id] = (num_tokens, now)
        if delta.finished:
            self._progress.pop(delta.request_id, None)
            self.e2e.labels(**self._labels).observe(now - start)
            self.prompt_tokens.labels(**self._labels).inc(len(delta.prompt_token_ids))
            self.generation_tokens.labels(**self._labels).inc(num_tokens)
            self.requests_finished.labels(**self._labels).inc()

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
