"""Decoder layers as one C++ call each (the CPU backend's default) against the same layers
through their modules (MMSERVE_CPU_DECODER_LAYER=modules): on mixed steps of prompt chunks and
decode rows, with images, the same tokens and the same log-probabilities bit for bit. (Both
against transformers: tests/models/test_qwen_vl_vs_transformers.py runs the fused layers.)"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from mmserve.config import CacheConfig, ExecutionConfig, SchedulerConfig
from mmserve.layers.decoder_layer import PreNormDecoderLayer
from mmserve.layers.fused_decoder_layer import FusedDecoderLayer
from mmserve.models.registry import load_model_config
from mmserve.testing.driver import ChunkedDriver
from mmserve.testing.reference import Reference, synthetic_image
from mmserve.worker.model_runner import ModelRunner


def cpu_runner(model_dir, decoder_layer: str, dtype: str) -> ModelRunner:
    with mock.patch.dict("os.environ", {"MMSERVE_CPU_DECODER_LAYER": decoder_layer}):
        runner = ModelRunner(
            load_model_config(model_dir, dtype=dtype),
            CacheConfig(block_size=16),
            SchedulerConfig(max_num_seqs=8),
            torch.device("cpu"),
            ExecutionConfig(attention_backend="cpu"),
        )
    runner.initialize_kv_cache(num_blocks=256)
    return runner


def decoder_layers(runner: ModelRunner) -> list[PreNormDecoderLayer | FusedDecoderLayer]:
    return list(runner.model.language_model.layers)


def are_fused(layers: list[PreNormDecoderLayer | FusedDecoderLayer]) -> list[bool]:
    return [isinstance(layer, FusedDecoderLayer) for layer in layers]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_match_their_modules_bit_for_bit(model_dir, dtype):
    fused, modules = cpu_runner(model_dir, "fused", dtype), cpu_runner(model_dir, "modules", dtype)
    layers = decoder_layers(fused)  # bfloat16 linears on oneDNN where it computes bfloat16: fused too
    assert layers and all(are_fused(layers))
    assert not any(are_fused(decoder_layers(modules)))
    reference = Reference(model_dir)
    text = [{"type": "text", "text": "Describe the picture, then count the shapes."}]
    with_image = [{"role": "user", "content": [{"type": "image"}, *text]}]
    prompts = [
        reference.build_prompt(with_image, [synthetic_image(96, 64, seed=0)]),
        reference.build_prompt([{"role": "user", "content": text}], []),
    ]
    got = ChunkedDriver(fused).generate(prompts, 12, chunk_size=16)
    want = ChunkedDriver(modules).generate(prompts, 12, chunk_size=16)
    for ours, theirs in zip(got, want, strict=True):
        assert ours.output == theirs.output
        for step_got, step_want in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert step_got.token_ids == step_want.token_ids
            assert step_got.logprobs == step_want.logprobs


def test_layers_off_the_cpu_kernels_stay_unfused(model_dir):
    runner = ModelRunner(
        load_model_config(model_dir, dtype="float32"),
        CacheConfig(block_size=16),
        SchedulerConfig(max_num_seqs=8),
        torch.device("cpu"),
        ExecutionConfig(attention_backend="torch"),
    )
    assert decoder_layers(runner) and not any(are_fused(decoder_layers(runner)))
