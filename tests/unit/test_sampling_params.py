"""SamplingParams: validation, normalisation, generation-config defaults, msgpack round trip."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType, StructuredOutputsParams

BAD_VALUES = [
    ("n", 0),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("min_tokens", 17),  # more than the default max_tokens of 16
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("seed", 1.0),
    ("seed", "7"),
    ("seed", True),
    ("seed", 2**64),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop_token_ids", [-1]),
    ("truncate_prompt_tokens", 0),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_value_raises_naming_the_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 0.01},
        {"max_tokens": None, "min_tokens": 100_000},
        {"max_tokens": 5, "min_tokens": 5},
        {"logprobs": 0, "prompt_logprobs": MAX_LOGPROBS, "seed": -(2**63)},
    ],
)
def test_edge_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)


def test_stop_and_top_k_are_normalised() -> None:
    params = SamplingParams(stop="\n\n", top_k=-1)
    assert params.stop == ["\n\n"]
    assert params.stop_token_ids == []
    assert params.top_k == 0
    assert SamplingParams().stop == []


def test_sampling_type_and_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=9e-6).is_greedy
    assert SamplingParams(temperature=1e-5).sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED


def test_clone_owns_its_lists() -> None:
    params = SamplingParams(stop=["a"], stop_token_ids=[1])
    clone = params.clone()
    clone.stop.append("b")
    clone.stop_token_ids.append(2)
    assert params.stop == ["a"] and params.stop_token_ids == [1]
    assert clone == SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])


def test_clone_equals_the_original_and_shares_no_mutable_field() -> None:
    params = SamplingParams(
        stop=["x"],
        logit_bias={3: 1.5},
        allowed_token_ids=[4, 5],
        bad_words_token_ids=[[6, 7]],
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        eos_token_ids=[9],
        seed=3,
    )
    clone = params.clone()
    assert clone == params
    clone.logit_bias[3] = 0.0
    clone.bad_words_token_ids[0].append(8)
    clone.structured_outputs.choice.append("maybe")
    clone.eos_token_ids.append(10)
    assert params.logit_bias == {3: 1.5} and params.bad_words_token_ids == [[6, 7]]
    assert params.structured_outputs.choice == ["yes", "no"] and params.eos_token_ids == [9]


QWEN2_VL_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "repetition_penalty": 1.05,
    "temperature": 0.1,
    "top_k": 1,
    "top_p": 0.001,
    "max_new_tokens": 2048,
}


def test_generation_config_fills_only_fields_left_at_their_default() -> None:
    params = SamplingParams(temperature=0.7, max_tokens=64, stop_token_ids=[5])
    params.update_from_generation_config(QWEN2_VL_GENERATION_CONFIG)
    assert params.temperature == 0.7 and params.max_tokens == 64  # set by the user: kept
    assert params.top_k == 1 and params.top_p == 0.001 and params.repetition_penalty == 1.05
    assert params.eos_token_ids == [151645, 151643]
    assert params.stop_token_ids == [5]
    assert params.all_stop_token_ids == {5, 151645, 151643}


def test_generation_config_then_client_fields_gives_exact_precedence() -> None:
    base = SamplingParams()
    base.update_from_generation_config(QWEN2_VL_GENERATION_CONFIG)
    params = dataclasses.replace(base, temperature=1.0)  # the client sent the default explicitly
    assert params.temperature == 1.0 and params.top_k == 1
    assert params.eos_token_ids == [151645, 151643]


def test_generation_config_eos_is_an_int_or_a_list_and_is_not_duplicated() -> None:
    params = SamplingParams()
    params.update_from_generation_config({"eos_token_id": 2})
    params.update_from_generation_config({"eos_token_id": [2, 3]})
    assert params.eos_token_ids == [2, 3]


def test_ignore_eos_keeps_user_stop_ids_only() -> None:
    params = SamplingParams(ignore_eos=True, stop_token_ids=[9], eos_token_ids=[2])
    assert params.all_stop_token_ids == {9}


def test_generation_config_values_are_normalised_like_arguments() -> None:
    params = SamplingParams()
    params.update_from_generation_config({"top_k": -1, "max_new_tokens": 100})
    assert params.top_k == 0 and params.max_tokens == 100


def test_invalid_generation_config_is_rejected_and_leaves_params_unchanged() -> None:
    params = SamplingParams()
    with pytest.raises(ValueError, match="top_p"):
        params.update_from_generation_config({"top_p": 0.0, "temperature": 0.5, "eos_token_id": 2})
    assert params == SamplingParams()


def test_msgpack_round_trip() -> None:
    params = SamplingParams(
        n=2,
        temperature=0.5,
        top_k=-1,
        stop="END",
        stop_token_ids=[3],
        seed=2**64 - 1,
        max_tokens=None,
        logprobs=5,
        eos_token_ids=[2],
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params


def test_msgpack_decode_validates() -> None:
    payload = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(ValueError, match="temperature"):
        msgspec.msgpack.decode(payload, type=SamplingParams)


@given(
    temperature=st.floats(0, 5),
    top_p=st.floats(1e-6, 1),
    top_k=st.integers(-1, 1000),
    penalty=st.floats(-2, 2),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop=st.none() | st.text(min_size=1) | st.lists(st.text(min_size=1), max_size=3),
)
def test_any_valid_params_survive_msgpack(
    temperature: float, top_p: float, top_k: int, penalty: float, seed: int | None, stop: object
) -> None:
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, presence_penalty=penalty, seed=seed, stop=stop
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
