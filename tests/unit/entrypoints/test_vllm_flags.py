"""vLLM's flags, typed by habit: each is applied, or accepted with a line saying why it changes
nothing, or refused with an error naming it. Problems found before loading (a Hub id, a folder
without a tokenizer, a taken port) are one line and exit status 2, never a traceback."""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import subprocess
import sys

import pytest

from mmserve import __version__, cli
from mmserve.entrypoints import serve_args, vllm_flags
from mmserve.frontend.chat_parsing import PromptError
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import png_bytes, synthetic_image
from mmserve.testing.server import free_port


def parse_serve(*flags: str):
    return cli.build_parser(["serve"]).parse_args(["serve", *flags])


@pytest.fixture(scope="module")
def model_path():
    return checkpoint("qwen2_vl")


def serve_exit(capsys, *flags: str) -> tuple[int, str]:
    """Run `mmserve serve FLAGS` in this process up to its pre-flight checks; (status, stderr)."""
    status = cli.main(["serve", *flags, "--port", str(free_port())])
    return status, capsys.readouterr().err


def test_tensor_parallel_size_and_its_short_flag_reach_the_parallel_config(model_path):
    for flags in (("-tp", "2"), ("--tensor-parallel-size", "2")):
        args = parse_serve(str(model_path), *flags)
        assert serve_args.engine_args_from_cli(args).create_engine_config().parallel.tensor_parallel_size == 2


def test_enforce_eager_reaches_the_execution_config(model_path):
    args = parse_serve(str(model_path), "--enforce-eager")
    config = serve_args.engine_args_from_cli(args).create_engine_config()
    assert config.execution.enforce_eager is True


def test_gpu_memory_utilization_sets_the_memory_utilization(model_path):
    args = parse_serve(str(model_path), "--gpu-memory-utilization", "0.5")
    assert serve_args.engine_args_from_cli(args).create_engine_config().cache.memory_utilization == 0.5


@pytest.mark.parametrize(
    "flag,reason",
    [
        ("--trust-remote-code", "runs its own model code"),
        ("--disable-log-requests", "does not log requests"),
    ],
)
def test_flags_that_change_nothing_here_are_accepted_with_a_line_saying_why(model_path, flag, reason):
    notes = vllm_flags.no_effect_notes(parse_serve(str(model_path), flag))
    assert len(notes) == 1
    assert notes[0].startswith(f"{flag} is accepted and changes nothing") and reason in notes[0]


def test_trust_request_mm_kwargs_is_refused_by_name(model_path, capsys):
    status, err = serve_exit(capsys, str(model_path), "--trust-request-mm-kwargs")
    assert status == 2 and "--trust-request-mm-kwargs" in err and "--mm-processor-kwargs" in err


def test_several_served_model_names_are_names_not_a_model_folder(model_path):
    args = parse_serve(str(model_path), "--served-model-name", "first", "second")
    assert args.model == str(model_path)
    config = serve_args.server_config_from_cli(args)
    assert config.served_model_name == "first"
    assert config.served_model_names == ("first", "second")


def test_chat_template_from_a_file_or_a_string_replaces_the_folders(model_path, tmp_path):
    template = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
    template_file = tmp_path / "template.jinja"
    template_file.write_text(template)
    for value in (str(template_file), template):
        config = serve_args.server_config_from_cli(parse_serve(str(model_path), "--chat-template", value))
        assert config.chat_template == template
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        serve_args.server_config_from_cli(parse_serve(str(model_path), "--chat-template", "no/such.jinja"))
    engine_config = serve_args.engine_args_from_cli(
        parse_serve(str(model_path), "--preprocess-workers", "0")
    ).create_engine_config()
    frontend = build_frontend(engine_config, MediaLoader(), open_ended=True, chat_template=template)
    try:
        prompt = frontend.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        frontend.close()
    assert prompt == "<<user>>hi"


def test_mm_processor_kwargs_bound_every_image_and_the_encoder_budget(model_path):
    """max_pixels of 64 merged tokens (28 x 28 pixels each): a large image becomes at most 64."""
    max_pixels = 64 * 28 * 28
    flags = ("--preprocess-workers", "0", "--mm-processor-kwargs", json.dumps({"max_pixels": max_pixels}))
    config = serve_args.engine_args_from_cli(parse_serve(str(model_path), *flags)).create_engine_config()
    assert config.multimodal.processor_kwargs == {"max_pixels": max_pixels}
    assert config.model.max_image_tokens == 64
    default = serve_args.engine_args_from_cli(
        parse_serve(str(model_path), "--preprocess-workers", "0")
    ).create_engine_config()
    image = png_bytes(synthetic_image(640, 480, seed=3))
    tokens = {}
    for name, engine_config in (("bounded", config), ("default", default)):
        frontend = build_frontend(engine_config, MediaLoader(), open_ended=True)
        try:
            processed = frontend.pool.process(image)
            tokens[name] = processed.num_tokens
            processed.release()
        finally:
            frontend.close()
    assert tokens["bounded"] <= 64 < tokens["default"]


def test_mm_processor_kwargs_refuse_other_settings():
    with pytest.raises(SystemExit):
        parse_serve("m", "--mm-processor-kwargs", '{"do_resize": false}')


def test_version_is_printed_by_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "mmserve.cli", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.strip() == f"mmserve {__version__}"


@pytest.mark.parametrize(
    "flag,default",
    [
        ("--max-num-seqs", "128"),
        ("--max-num-batched-tokens", "2048"),
        ("--block-size", "16"),
        ("--kv-cache-memory", "auto"),
        ("--mm-processor-cache-gb", "1.0"),
        ("--tensor-parallel-size", "1"),
    ],
)
def test_help_states_the_defaults(flag, default, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    metavar = flag[2:].upper().replace("-", "_")
    entry = re.search(rf"{flag} {metavar}(?:, -\w+ {metavar})? (.*?)(?= --|$)", text).group(1)
    assert f"(default {default})" in entry, entry


def test_a_hub_id_is_explained_in_one_line_before_anything_loads(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = serve_exit(capsys, "Qwen/Qwen2-VL-2B-Instruct")
    assert status == 2
    assert "serves local model folders only" in err
    assert "huggingface-cli download Qwen/Qwen2-VL-2B-Instruct" in err
    assert "Traceback" not in err


def test_a_folder_without_a_tokenizer_is_named_not_a_traceback(model_path, tmp_path, capsys):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(model_path, folder)
    (folder / "tokenizer.json").unlink()
    status, err = serve_exit(capsys, str(folder))
    assert status == 2
    assert "has no tokenizer.json (the tokenizer)" in err and "Traceback" not in err


def test_a_taken_port_is_reported_before_the_engine_loads(model_path, capsys):
    """The check returns at once: without it this call would load the engine and serve."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status = cli.main(["serve", str(model_path), "--port", str(port)])
    err = capsys.readouterr().err
    assert status == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


def test_a_request_cannot_set_the_servers_pixel_bounds(model_path):
    """Refused with the field named, not dropped: per-request bounds are not built."""
    config = serve_args.engine_args_from_cli(
        parse_serve(str(model_path), "--preprocess-workers", "0")
    ).create_engine_config()
    url = "data:image/png;base64," + base64.b64encode(png_bytes(synthetic_image(64, 64, seed=1))).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    frontend = build_frontend(config, MediaLoader(), open_ended=True)
    try:
        with pytest.raises(PromptError, match="--mm-processor-kwargs") as refused:
            frontend.inputs.chat(messages, {"max_pixels": 200704})
    finally:
        frontend.close()
    assert refused.value.param == "mm_processor_kwargs"
