"""Request schemas: what reaches SamplingParams, and what is refused by name."""

from __future__ import annotations

import pytest

from mmserve.entrypoints.openai.schemas import ChatCompletionRequest, CompletionRequest, FieldError
from mmserve.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "x"}]


def test_an_unknown_field_named_like_an_internal_param_does_not_reach_the_engine():
    request = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "eos_token_ids": [], "detokenize": False}
    )
    params = request.sampling_params(SamplingParams(eos_token_ids=[3]))
    assert params.eos_token_ids == [3] and params.detokenize


def test_openai_and_vllm_fields_map_onto_sampling_params():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": MESSAGES,
            "logit_bias": {"7": -100, "9": 5.5},
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "array"}},
            },
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    params = request.sampling_params(SamplingParams())
    assert params.logit_bias == {7: -100.0, 9: 5.5} and params.max_tokens == 9 and params.logprobs == 2
    assert params.structured_outputs.key == ("json", '{"type": "array"}')
    completion = CompletionRequest.model_validate(
        {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    )
    assert completion.sampling_params(SamplingParams()).structured_outputs.choice == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "field"),
    [({"store": True}, "store"), ({"service_tier": "priority"}, "service_tier"), ({"audio": {}}, "audio")],
)
def test_a_field_asking_for_what_the_server_lacks_is_refused_by_name(body, field):
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
    with pytest.raises(FieldError) as error:
        request.sampling_params(SamplingParams())
    assert error.value.field == field


def test_harmless_values_of_those_fields_pass():
    body = {"messages": MESSAGES, "store": False, "service_tier": "auto", "modalities": ["text"]}
    ChatCompletionRequest.model_validate(body).sampling_params(SamplingParams())
