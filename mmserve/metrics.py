"""Prometheus metrics with vLLM's names, labels and buckets under an `mmserve:` prefix.

A vLLM dashboard works once `vllm:` is replaced by `mmserve:`: the same gauges, counters
(`..._total`, no `_created` series) and per-request histograms, labelled `model_name` (the first
served name) and `engine` ("0": one EngineCore), request successes also by `finished_reason`.
mmserve adds a few of its own (KV blocks in use, encoder-cache counts).

Engine-side numbers arrive as SchedulerStats with every step (gauges, and cumulative counts
turned into counter increments); request timings are observed by the API server.
"""

from __future__ import annotations

import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mmserve.outputs import RequestOutput
from mmserve.protocol import SchedulerStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error")

# SchedulerStats field → counter name (the stats carry running totals)
_CUMULATIVE = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "encoder_runs": "encoder_runs",
    "encoder_cache_hits": "encoder_cache_hits",
}
# RequestOutput.metrics key → histogram (vLLM's per-request phases)
_PHASES = {
    "queue_time_s": ("request_queue_time_seconds", "Time from arrival in the engine to first scheduling."),
    "prefill_time_s": ("request_prefill_time_seconds", "Time from first scheduling to the first token."),
    "decode_time_s": ("request_decode_time_seconds", "Time from the first token to the last."),
    "inference_time_s": ("request_inference_time_seconds", "Time from first scheduling to the last token."),
}


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len, as vLLM buckets token counts."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    """The server's registry. prometheus_client's `_created` series are switched off for the
    whole process (as vLLM does): they double every counter and histogram, and no vLLM
    dashboard reads them."""

    def __init__(self, model_name: str, max_model_len: int = 4096) -> None:
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name, "engine": "0"}
        self._add_engine_metrics()
        self._add_request_metrics(max_model_len)
        self._last_totals: dict[str, int] = dict.fromkeys(_CUMULATIVE, 0)
        self._last_mm = (0, 0)
        self._progress: dict[str, tuple[int, float]] = {}  # request id → (tokens seen, last token time)

    # Each returns the one labelled child, made now so that every series is exported from the
    # start (at 0), as vLLM's are.
    def _gauge(self, name: str, doc: str) -> Gauge:
        metric = Gauge(f"mmserve:{name}", doc, list(self._labels), registry=self.registry)
        return metric.labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        metric = Counter(f"mmserve:{name}", doc, list(self._labels), registry=self.registry)
        return metric.labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        metric = Histogram(
            f"mmserve:{name}", doc, list(self._labels), buckets=buckets, registry=self.registry
        )
        return metric.labels(**self._labels)

    def _add_engine_metrics(self) -> None:
        """What the engine and the preprocess pool report: load, caches, preemptions."""
        gauge, counter = self._gauge, self._counter
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_blocks = gauge("kv_cache_blocks_in_use", "KV cache blocks held by requests.")
        self.encoder_refs = gauge("encoder_cache_references", "Encoder-cache entries referenced by requests.")
        self.preprocess_pending = gauge("preprocess_pending", "Images and videos being preprocessed now.")
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

    def _add_request_metrics(self, max_model_len: int) -> None:
        """What the API server sees of each request: tokens, latencies, how it finished."""
        counter, histogram = self._counter, self._histogram
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.request_success = Counter(
            "mmserve:request_success",
            "Finished requests, by finish reason.",
            [*self._labels, "finished_reason"],
            registry=self.registry,
        )
        for reason in FINISHED_REASONS:  # every reason exported from the start, at 0
            self.request_success.labels(**self._labels, finished_reason=reason)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", tokens
        )
        self.request_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each request.", tokens
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Decode time per generated token.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", _REQUEST_BUCKETS
        )
        self.phases = {key: histogram(name, doc, _REQUEST_BUCKETS) for key, (name, doc) in _PHASES.items()}

    def update_engine(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks.set(stats.kv_blocks_in_use)
        self.encoder_refs.set(stats.encoder_cache_references)
        for field, name in _CUMULATIVE.items():
            total = getattr(stats, field)
            if total > self._last_totals[field]:
                self.counters[name].inc(total - self._last_totals[field])
            self._last_totals[field] = total

    def update_preprocess(self, queries: int, hits: int, pending: int = 0) -> None:
        """The preprocess pool's running totals (cache queries, hits) and its computations in flight."""
        self.preprocess_pending.set(pending)
        q0, h0 = self._last_mm
        if queries > q0:
            self.mm_cache_queries.inc(queries - q0)
        if hits > h0:
            self.mm_cache_hits.inc(hits - h0)
        self._last_mm = (queries, hits)

    def observe_request(self, delta: RequestOutput, start: float, max_tokens: int | None = None) -> None:
        """Called with each delta of a request (RequestOutputKind.DELTA) as it streams in;
        `start` is when the API server received it."""
        now = time.monotonic()
        seen, last_time = self._progress.get(delta.request_id, (0, start))
        num_tokens = seen + sum(len(c.token_ids) for c in delta.outputs)
        if num_tokens > seen:
            if seen == 0:
                self.ttft.observe(now - start)
            else:
                gap = (now - last_time) / (num_tokens - seen)
                for _ in range(num_tokens - seen):
                    self.itl.observe(gap)
            self._progress[delta.request_id] = (num_tokens, now)
        if delta.finished:
            self._progress.pop(delta.request_id, None)
            self._observe_finished(delta, now - start, num_tokens, max_tokens)

    def _observe_finished(
        self, output: RequestOutput, e2e_s: float, num_tokens: int, max_tokens: int | None
    ) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_tokens)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_tokens)
        if max_tokens is not None:
            self.request_max_tokens.observe(max_tokens)
        for key, histogram in self.phases.items():
            if key in output.metrics:
                histogram.observe(output.metrics[key])
        if num_tokens > 1 and "decode_time_s" in output.metrics:
            self.tpot.observe(output.metrics["decode_time_s"] / (num_tokens - 1))
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason in FINISHED_REASONS]
        reason = "error" if output.error else (reasons or ["stop"])[0]
        self.request_success.labels(**self._labels, finished_reason=reason).inc()

    def forget(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
