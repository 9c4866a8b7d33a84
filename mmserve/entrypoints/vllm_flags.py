"""vLLM flags that users type by habit and that mean nothing new here.

Each is either applied (`--uvicorn-log-level`, `--chat-template`), accepted with one log line
saying why it changes nothing (`--trust-remote-code`: mmserve runs its own model code), or
refused with an error naming it where doing it is not built (`--trust-request-mm-kwargs`).
None is accepted and silently dropped. The flags with an mmserve meaning of their own
(`--gpu-memory-utilization`, several `--served-model-name`s, `--mm-processor-kwargs`,
`-tp`, `--enforce-eager`) live with their fields in serve_args.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# flag dest → why it changes nothing in mmserve (logged once when it is given)
NO_EFFECT = {
    "trust_remote_code": "mmserve runs its own model code, never a model folder's Python files",
    "disable_log_requests": "mmserve does not log requests",
}


def add_vllm_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--trust-remote-code", action="store_true", help="Accepted; mmserve runs no model-folder code."
    )
    group.add_argument(
        "--disable-log-requests", action="store_true", help="Accepted; mmserve does not log requests."
    )
    group.add_argument(
        "--trust-request-mm-kwargs",
        action="store_true",
        help="Refused: requests cannot set min_pixels/max_pixels yet (use --mm-processor-kwargs).",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="A Jinja chat template, or a file holding one, used instead of the model folder's.",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="Log level of the HTTP server's own lines (default: --log-level).",
    )


def refusals(args: argparse.Namespace) -> list[str]:
    """Why the given flags cannot be served as asked (empty when they can)."""
    problems = []
    if args.trust_request_mm_kwargs:
        problems.append(
            "--trust-request-mm-kwargs: requests cannot set min_pixels/max_pixels yet; set them for "
            """the server with --mm-processor-kwargs '{"max_pixels": 1003520}'"""
        )
    return problems


def no_effect_notes(args: argparse.Namespace) -> list[str]:
    """One line per given flag that changes nothing here, saying why."""
    return [
        f"--{dest.replace('_', '-')} is accepted and changes nothing: {why}"
        for dest, why in NO_EFFECT.items()
        if getattr(args, dest)
    ]


def load_chat_template(value: str | None) -> str | None:
    """--chat-template FILE|STRING → the template's source, as vLLM reads it: an existing file's
    text, else the value itself if it looks like Jinja; a path-like value that is no file is an
    error (a typo should not become a template that prints the path)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(mark in value for mark in ("{{", "{%")):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
