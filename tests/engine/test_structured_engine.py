"""Structured outputs through the offline engine (real xgrammar, the tiny model), the engine's
own token-id check, and the KV cache sized from free memory."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from mmserve import LLM, SamplingParams
from mmserve.protocol import EngineRequest
from mmserve.sampling_params import StructuredOutputsParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.worker.worker import available_memory_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["shape", "size", "tags"],
}
PROMPTS = [f"Describe picture {i} as JSON:" for i in range(4)]


def structured(**options) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), max_tokens=60, **options)


@pytest.fixture(scope="module")
def model_dir():
    return checkpoint("qwen2_vl")


def answers(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [c.token_ids for output in llm.generate(PROMPTS, params) for c in output.outputs]


def test_json_answers_validate_and_survive_preemption_unchanged(model_dir):
    with LLM(model_dir, num_kv_blocks=512, max_num_batched_tokens=64) as roomy:
        expected = answers(roomy, structured(temperature=0))
        sampled = roomy.generate(PROMPTS, structured(temperature=1.0, seed=7, n=2))
        manager = roomy.engine_core.scheduler.grammar.tracker
        assert len(manager._grammars) == 1  # one schema, compiled once for 12 requests
    for output in sampled:
        for completion in output.outputs:
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), SCHEMA)
    with LLM(model_dir, num_kv_blocks=24, block_size=4, max_num_batched_tokens=64) as cramped:
        assert answers(cramped, structured(temperature=0)) == expected
        assert cramped.stats().num_preemptions > 0


def test_the_engine_refuses_token_ids_outside_the_vocabulary_without_raising(model_dir):
    with LLM(model_dir, num_kv_blocks=64) as llm:
        core = llm.engine_core
        params = SamplingParams(stop_token_ids=[1_000_000], min_tokens=2, max_tokens=4)
        core.add_request(
            EngineRequest(
                request_id="x",
                prompt_token_ids=[1, 2],
                mm_features=[],
                sampling_params=params,
                arrival_time=time.monotonic(),
            )
        )
        [output] = core.step().outputs
        assert output.finish_reason == "error" and "stop_token_ids" in output.error
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate("hi", SamplingParams(allowed_token_ids=[10**7]))


def test_auto_kv_cache_takes_free_memory_up_to_what_requests_can_use(model_dir):
    with LLM(model_dir, max_num_seqs=2, max_model_len=256, block_size=16) as llm:
        assert llm.engine_core.scheduler.kv.pool.num_blocks == 2 * 256 // 16
    assert available_memory_bytes() > 0


def test_available_memory_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert available_memory_bytes(meminfo) == 2048 * 1024
