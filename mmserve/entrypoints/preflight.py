"""Checks `mmserve serve` runs before it loads anything: a mistake in the model path or a taken
port is reported in one line at once, not after the engine has loaded (or as a traceback)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

# What a model folder must hold, and what each file is for (named in the error).
REQUIRED_FILES = {
    "config.json": "the model's configuration",
    "tokenizer.json": "the tokenizer",
    "preprocessor_config.json": "the image processor's settings",
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def model_folder_problem(model: str) -> str | None:
    """Why `model` cannot be served (None when it can be tried): a missing path (with a hint
    when it looks like a Hugging Face Hub id), a file, or a folder lacking a required file."""
    path = Path(model).expanduser()
    if not path.exists():
        if _HUB_ID.fullmatch(model):
            return (
                f"{model!r} is not a folder here. mmserve serves local model folders only; if this is "
                f"a Hugging Face Hub id, download it first:\n"
                f"  huggingface-cli download {model} --local-dir models/{model.split('/')[-1]}\n"
                f"then serve that folder: mmserve serve models/{model.split('/')[-1]}"
            )
        return f"no model folder at {path}"
    if not path.is_dir():
        return f"{path} is a file; give the model's folder (the one holding config.json)"
    missing = [f"{name} ({what})" for name, what in REQUIRED_FILES.items() if not (path / name).is_file()]
    if missing:
        return f"{path} is not a complete model folder: it has no {', '.join(missing)}"
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (None when it can): checked by binding a
    socket as the server will (with SO_REUSEADDR, as uvicorn does), then closing it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}; pick another with --port"
    return None
