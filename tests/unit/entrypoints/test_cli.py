"""`mmserve serve` and `LLM(...)` take the same engine arguments with the same defaults, the
scheduling policy reaches the scheduler's config from both, and `serve` never loads the
benchmark package."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmserve import cli
from mmserve.config import ServerConfig
from mmserve.engine_args import EngineArgs
from mmserve.entrypoints import flag_parsers, serve_args
from mmserve.entrypoints.llm import LLM
from mmserve.testing.checkpoints import checkpoint


def parse_serve(*flags: str):
    return cli.build_parser(["serve"]).parse_args(["serve", *flags])


@pytest.fixture(scope="module")
def model_path():
    return checkpoint("qwen2_vl")


def test_every_engine_arg_is_a_serve_flag_with_the_same_default():
    assert serve_args.engine_args_from_cli(parse_serve("some/model")) == EngineArgs(model="some/model")


def test_every_server_flag_defaults_to_the_server_config(monkeypatch):
    monkeypatch.delenv("MMSERVE_API_KEY", raising=False)
    assert serve_args.server_config_from_cli(parse_serve("some/model")) == ServerConfig(
        served_model_name="model"
    )


def test_serve_flags_reach_their_config_slices(model_path):
    args = parse_serve(
        str(model_path),
        "--scheduling-policy",
        "priority",
        "--num-kv-blocks",
        "40",
        "--kv-cache-memory",
        "64MiB",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--max-waiting-requests",
        "5",
        "--no-enable-prefix-caching",
    )
    config = serve_args.engine_args_from_cli(args).create_engine_config()
    assert config.scheduler.scheduling_policy == "priority"
    assert config.scheduler.max_waiting_requests == 5
    assert config.cache.num_blocks == 40
    assert config.cache.kv_cache_memory_bytes == 64 << 20
    assert not config.cache.enable_prefix_caching
    assert config.multimodal.max_images_per_prompt == 2


def test_the_scheduling_policy_defaults_to_fcfs_and_takes_no_other_value(model_path, capsys):
    config = serve_args.engine_args_from_cli(parse_serve(str(model_path))).create_engine_config()
    assert config.scheduler.scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parse_serve(str(model_path), "--scheduling-policy", "lottery")
    assert "--scheduling-policy" in capsys.readouterr().err


def test_llm_sets_the_scheduling_policy(model_path):
    with LLM(model_path, scheduling_policy="priority", num_kv_blocks=64) as llm:
        assert llm.config.scheduler.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(model_path, scheduling_policy="lottery")


def test_llm_builds_the_config_serve_builds_but_for_inline_preprocessing(model_path):
    """Offline, images are preprocessed in the caller's process; every other default is shared."""
    with LLM(model_path) as llm:
        offline = llm.config
    served = serve_args.engine_args_from_cli(parse_serve(str(model_path))).create_engine_config()
    assert offline.multimodal.preprocess_workers == 0
    assert served.multimodal.preprocess_workers is None
    assert offline.scheduler == served.scheduler
    assert offline.cache == served.cache
    assert offline.multimodal.limit_per_prompt == served.multimodal.limit_per_prompt == {"image": 8}
    assert (offline.seed, offline.device, offline.model) == (served.seed, served.device, served.model)


def test_importing_the_cli_loads_neither_torch_nor_the_benchmark_package():
    """Spawned children (EngineCore, preprocess workers) import the main module again: a
    preprocess worker that loaded torch there would start and exit seconds slower."""
    script = (
        "import sys\n"
        "import mmserve.cli\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('mmserve.bench')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_serve_does_not_import_the_benchmark_package():
    script = (
        "import sys\n"
        "from mmserve import cli\n"
        "try:\n"
        "    cli.main(['serve', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('mmserve.bench')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "--scheduling-policy" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_bench_serve_help_lists_the_benchmark_flags():
    result = subprocess.run(
        [sys.executable, "-m", "mmserve.cli", "bench", "serve", "--help"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "--dataset-path" in result.stdout and "--max-concurrency" in result.stdout


@pytest.mark.parametrize("text,expected", [("2GiB", 2 << 30), ("64MiB", 64 << 20), ("1000", 1000)])
def test_sizes_in_help_read_back_as_the_same_bytes(text, expected):
    assert flag_parsers.parse_bytes(text) == expected
    assert flag_parsers.parse_bytes(flag_parsers.format_bytes(expected)) == expected
