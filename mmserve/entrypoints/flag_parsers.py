"""The value parsers of `mmserve serve`'s flags (argparse `type=` callables): sizes ('2GiB'),
the JSON-object flags checked against what their config fields take, and vLLM's list forms.
Each raises argparse.ArgumentTypeError with the form it expects, so a bad flag is named.
"""

from __future__ import annotations

import argparse
import json
import re

from mmserve.config import CompilationConfig

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1 << 20}
_UNITS |= {"g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'2147483648', '2GiB', '1.5 GB' → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_kv_cache_memory(text: str) -> int | None:
    """'auto' → None (sized from free memory); otherwise a size like parse_bytes."""
    return None if text.strip().lower() == "auto" else parse_bytes(text)


def format_bytes(num_bytes: int) -> str:
    """2147483648 → '2GiB' (whole binary units only; otherwise the number of bytes)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


def parse_limit_mm(text: str) -> dict[str, int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"--limit-mm-per-prompt takes JSON like '{{\"image\": 4}}', got {text!r}"
        ) from None
    if not isinstance(value, dict) or not all(
        isinstance(count, int) and count >= 0 for count in value.values()
    ):
        raise argparse.ArgumentTypeError("--limit-mm-per-prompt maps modality names to counts ≥ 0")
    return value


def parse_media_io_kwargs(text: str) -> dict[str, dict]:
    """--media-io-kwargs '{"video": {"num_frames": 16}}' (or {"fps": 2}), as vLLM names it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f'--media-io-kwargs takes JSON like \'{{"video": {{"num_frames": 16}}}}\', got {text!r}'
        ) from None
    video = value.get("video", {}) if isinstance(value, dict) else None
    if set(value or {}) - {"video"} or not isinstance(video, dict) or set(video) - {"num_frames", "fps"}:
        raise argparse.ArgumentTypeError('--media-io-kwargs sets {"video": {"num_frames": N} or {"fps": F}}')
    return value


def parse_compilation_config(text: str) -> dict:
    """--compilation-config '{"level": 1}': a JSON object of CompilationConfig's fields."""
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("not an object")
        CompilationConfig.from_dict(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--compilation-config: {e} (got {text!r})") from None
    return value


def parse_mm_processor_kwargs(text: str) -> dict[str, int]:
    """--mm-processor-kwargs '{"min_pixels": 3136, "max_pixels": 1003520}', as vLLM names it: a
    JSON object of positive integers (which keys a model takes is its family's, checked when
    its folder is read)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value.values()
    ):
        raise argparse.ArgumentTypeError(
            "--mm-processor-kwargs takes a JSON object of positive integers, "
            f"""e.g. '{{"max_pixels": 1003520}}'; got {text!r}"""
        )
    return value


def parse_list(values: list[str]) -> tuple[str, ...]:
    """Space-separated values, or vLLM's JSON list form ('["a", "b"]'), or both."""
    items: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
            items.extend(str(item) for item in parsed)
        else:
            items.append(value)
    return tuple(items)
