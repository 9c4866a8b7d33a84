"""Tensor-parallel settings: vLLM's flag names, and splits the model cannot take refused with a
message that names the shape at fault, before any worker starts."""

from __future__ import annotations

import argparse

import pytest

from mmserve.config import ParallelConfig
from mmserve.engine_args import EngineArgs
from mmserve.entrypoints.serve_args import add_serve_arguments, engine_args_from_cli
from mmserve.testing.checkpoints import checkpoint


def test_flags_have_vllms_names():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = engine_args_from_cli(parser.parse_args(["m", "-tp", "2", "--distributed-executor-backend", "ray"]))
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "ray")
    args = engine_args_from_cli(parser.parse_args(["m", "--tensor-parallel-size", "3"]))
    assert args.tensor_parallel_size == 3 and args.mm_encoder_tp_mode == "weights"


def test_backend_defaults_to_in_process_for_one_rank_and_processes_for_more():
    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 0}, "must be ≥ 1"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "'uni' runs one rank"),
        ({"distributed_executor_backend": "slurm"}, "must be one of mp, ray, uni"),
        ({"mm_encoder_tp_mode": "pipeline"}, "must be one of weights, data"),
    ],
)
def test_unsupported_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**settings)


def test_a_split_the_heads_do_not_allow_is_refused():
    tiny = checkpoint("qwen2_vl")  # 4 heads, 2 KV heads, a vision tower of 4 heads
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads 4"):
        EngineArgs(model=tiny, tensor_parallel_size=3).create_engine_config()
    # 4 ranks replicate each of the 2 KV heads on 2 ranks: allowed
    assert EngineArgs(model=tiny, tensor_parallel_size=4).create_engine_config().parallel.world_size == 4
    tp3 = checkpoint("qwen2_vl", "tp3")
    assert EngineArgs(model=tp3, tensor_parallel_size=3).create_engine_config().parallel.world_size == 3
    with pytest.raises(ValueError, match="num_attention_heads 6"):
        EngineArgs(model=tp3, tensor_parallel_size=4).create_engine_config()
