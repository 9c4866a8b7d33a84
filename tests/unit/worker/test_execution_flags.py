"""--attention-backend flash_attn, --enforce-eager and --compilation-config: from the flag to the
config slice the model runner reads, and the errors a wrong value gets."""

from __future__ import annotations

import pytest

from mmserve import cli
from mmserve.config import CompilationConfig
from mmserve.entrypoints import serve_args
from mmserve.entrypoints.llm import LLM
from mmserve.ops import flash_attn as flash_attn_ops
from mmserve.testing.checkpoints import checkpoint


def serve_config(*flags: str):
    args = cli.build_parser(["serve"]).parse_args(["serve", str(checkpoint("qwen2_vl")), *flags])
    return serve_args.engine_args_from_cli(args).create_engine_config()


def test_serve_takes_the_gpu_flags():
    config = serve_config(
        "--attention-backend",
        "flash_attn",
        "--enforce-eager",
        "--compilation-config",
        '{"level": 1, "cudagraph_capture_sizes": [4, 1, 2]}',
    )
    assert config.execution.attention_backend == "flash_attn"
    assert config.execution.enforce_eager
    assert config.execution.compilation == CompilationConfig(level=1, cudagraph_capture_sizes=(4, 1, 2))


def test_by_default_compiled_on_cuda_only():
    compilation = serve_config().execution.compilation
    assert compilation == CompilationConfig()
    assert compilation.compiles("cuda")
    assert not compilation.compiles("cpu")
    assert CompilationConfig(level=1).compiles("cpu")
    assert not CompilationConfig(level=0).compiles("cuda")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"level": 3}', "compilation level must be one of"),
        ('{"mode": 1}', "unknown keys"),
        ('{"cudagraph_capture_sizes": [0]}', "integers ≥ 1"),
        ("[1]", "not an object"),
        ("level=1", "Expecting value"),
    ],
)
def test_a_bad_compilation_config_is_refused_at_parse_time(text, message, capsys):
    with pytest.raises(SystemExit):
        serve_config("--compilation-config", text)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(flash_attn_ops.is_installed(), reason="flash_attn is installed here")
def test_llm_with_flash_attn_missing_fails_before_loading_with_the_reason():
    with pytest.raises(ValueError, match="flash_attn package is not installed"):
        LLM(checkpoint("qwen2_vl"), attention_backend="flash_attn")
