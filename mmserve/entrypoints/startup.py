"""The block the server logs once it is ready: what it serves, how, with what capacity, where.

Everything a first-time user asks after `mmserve serve` (which dtype? which device, how many
threads? how many requests fit? where is the chat page?) is answered here, in one place.
"""

from __future__ import annotations

from mmserve.config import EngineConfig, ServerConfig
from mmserve.protocol import EngineReady

_ANY_ADDRESS = ("", "0.0.0.0", "::")


def base_url(server_config: ServerConfig) -> str:
    """The address to open in a browser: a wildcard host is reached through 127.0.0.1."""
    host = "127.0.0.1" if server_config.host in _ANY_ADDRESS else server_config.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{server_config.port}"


def startup_report(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    ready: EngineReady,
    *,
    engine_pid: int,
    num_preprocess_workers: int,
    segment_prefix: str,
    start_time_s: float,
) -> str:
    """The lines of the ready block (no trailing newline). The processes row names what a
    supervisor or a clean-up looks for: EngineCore's pid and the shared-memory segments."""
    model = engine_config.model
    block_size = engine_config.cache.block_size
    num_tokens = ready.num_blocks * block_size
    names = ", ".join(repr(name) for name in server_config.served_model_names)
    workers = f"{num_preprocess_workers} worker processes" if num_preprocess_workers else "inline"
    url = base_url(server_config)
    rows = [
        ("model", f"{model.path} ({model.architecture}), served as {names}"),
        ("dtype", model.dtype),
        ("device", f"{ready.device}, {ready.num_threads} threads"),
        ("attention", ready.attention_backend),
        (
            "KV cache",
            f"{ready.num_blocks} blocks x {block_size} tokens = {num_tokens} tokens; max concurrency "
            f"{num_tokens / model.max_model_len:.2f} requests at max_model_len {model.max_model_len}",
        ),
        ("preprocess", workers),
        ("processes", f"EngineCore pid {engine_pid}; image segments {segment_prefix}* in /dev/shm"),
        ("started in", f"{start_time_s:.1f} s (model and KV cache: {ready.load_time_s:.1f} s)"),
        ("API", f"{url}/v1"),
        ("chat page", f"{url}/"),
        ("dashboard", f"{url}/dashboard (charts of {url}/metrics)"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(["mmserve is ready", *(f"  {label:<{width}}  {value}" for label, value in rows)])
