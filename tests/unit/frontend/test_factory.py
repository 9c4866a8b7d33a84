"""The frontend factory: what an unset max_tokens means offline and when serving, and the
pieces it builds from one EngineConfig."""

from __future__ import annotations

import json

import pytest

from mmserve.engine_args import EngineArgs
from mmserve.frontend.factory import build_frontend, default_sampling_params
from mmserve.frontend.media import MediaLoader
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint


@pytest.mark.parametrize("open_ended,expected", [(True, None), (False, SamplingParams().max_tokens)])
def test_without_max_new_tokens_only_the_server_runs_to_the_context_limit(tmp_path, open_ended, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "eos_token_id": [7, 9]}))
    params = default_sampling_params(tmp_path, open_ended=open_ended)
    assert params.max_tokens == expected
    assert params.temperature == 0.5
    assert params.eos_token_ids == [7, 9]


@pytest.mark.parametrize("open_ended", [True, False])
def test_the_model_max_new_tokens_wins_offline_and_served(tmp_path, open_ended):
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    assert default_sampling_params(tmp_path, open_ended=open_ended).max_tokens == 40


def test_no_generation_config_leaves_sampling_params_defaults(tmp_path):
    assert default_sampling_params(tmp_path, open_ended=False) == SamplingParams()


def test_without_generation_config_the_model_eos_still_stops(tmp_path):
    """The EOS ids ModelConfig read from config.json apply when generation_config.json is missing."""
    params = default_sampling_params(tmp_path, open_ended=True, eos_token_ids=(5,))
    assert params.eos_token_ids == [5]
    assert 5 in params.all_stop_token_ids


def test_config_json_eos_reaches_the_default_params(tmp_path):
    model = checkpoint("qwen2_vl")
    for name in model.iterdir():
        if name.name != "generation_config.json":
            (tmp_path / name.name).symlink_to(name)
    config = EngineArgs(model=tmp_path, preprocess_workers=0).create_engine_config()
    assert config.model.eos_token_ids  # from config.json
    frontend = build_frontend(config, MediaLoader(), open_ended=True)
    try:
        assert frontend.default_params.eos_token_ids == list(config.model.eos_token_ids)
    finally:
        frontend.close()


@pytest.mark.parametrize("limit,expected", [(None, 8), ({}, 8), ({"image": 3}, 3)])
def test_the_image_limit_reaches_the_input_processor(limit, expected):
    args = {} if limit is None else {"limit_mm_per_prompt": limit}
    config = EngineArgs(model=checkpoint("qwen2_vl"), preprocess_workers=0, **args).create_engine_config()
    frontend = build_frontend(config, MediaLoader(), open_ended=True)
    try:
        assert frontend.inputs.image_limit == expected
        assert frontend.inputs.tokenizer is frontend.tokenizer is frontend.outputs.tokenizer
        assert frontend.default_params.eos_token_ids  # from the checkpoint's generation_config.json
    finally:
        frontend.close()
