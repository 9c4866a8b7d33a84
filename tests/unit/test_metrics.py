"""/metrics as vLLM's: parsed with prometheus_client's own parser, vLLM's names and labels,
request successes by finish reason, the per-request phase histograms, no `_created` series."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from mmserve.metrics import ServerMetrics, token_buckets
from mmserve.outputs import CompletionOutput, RequestOutput


def finished(request_id: str, reason: str, num_tokens: int, metrics: dict[str, float]) -> RequestOutput:
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), finish_reason=reason)
    return RequestOutput(request_id, None, [1, 2, 3], [completion], finished=True, metrics=metrics)


def families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_a_finished_request_is_counted_by_reason_with_its_phases():
    metrics = ServerMetrics("demo", max_model_len=100)
    phases = {"queue_time_s": 0.01, "prefill_time_s": 0.2, "decode_time_s": 0.9, "inference_time_s": 1.1}
    metrics.observe_request(finished("a", "length", 4, phases), start=0.0, max_tokens=4)
    found = families(metrics)
    assert not [name for name in found if name.endswith("_created")]
    assert not [s for f in found.values() for s in f.samples if s.name.endswith("_created")]
    success = {s.labels["finished_reason"]: s.value for s in found["mmserve:request_success"].samples}
    assert success == {"stop": 0, "length": 1, "abort": 0, "error": 0}
    for name, value in (
        ("request_queue_time_seconds", 0.01),
        ("request_prefill_time_seconds", 0.2),
        ("request_decode_time_seconds", 0.9),
        ("request_inference_time_seconds", 1.1),
        ("request_time_per_output_token_seconds", 0.3),  # 0.9 s over the 3 tokens after the first
        ("request_prompt_tokens", 3),
        ("request_generation_tokens", 4),
        ("request_params_max_tokens", 4),
    ):
        samples = {s.name: s for s in found[f"mmserve:{name}"].samples}
        assert samples[f"mmserve:{name}_count"].value == 1, name
        assert abs(samples[f"mmserve:{name}_sum"].value - value) < 1e-9, name
        assert samples[f"mmserve:{name}_count"].labels == {"model_name": "demo", "engine": "0"}
    counters = {s.name: s.value for s in found["mmserve:generation_tokens"].samples}
    assert counters == {"mmserve:generation_tokens_total": 4}


def test_token_buckets_are_1_2_5_up_to_the_model_length():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096)[-1] == 2000
