"""The API server's own CPU work per request, stage by stage, on VisionArena-format rows.

    python -m benchmarks.api_request_cost MODEL_DIR --dataset-path /tmp/visionarena \
        --num-prompts 64 --output-len 32 --repeats 5

What the API server process does for one streamed chat request besides waiting: parse and
validate the JSON body, build the request's sampling params, decode the image's data URL,
hash it (the mm_hash), render the chat template, tokenise, expand the placeholders (the
pixels stay in shared memory: the request names them by handle), encode the request for
EngineCore; then, per output token, fold the engine's output in (detokenise) and build the
SSE chunk. The stages are the functions the server calls, timed one by one over every row
(CPU time of this thread, the median of `--repeats` passes, µs per request). Decoding and
resizing the image runs in the preprocess workers when serving, not in this process; it is
timed too (`preprocess`), for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mmserve.bench.dataset import load_conversations
from mmserve.bench.workload import sample_single_turn
from mmserve.engine_args import EngineArgs
from mmserve.entrypoints.openai.chat_messages import prepare_messages
from mmserve.entrypoints.openai.generation import sse
from mmserve.entrypoints.openai.schemas import ChatCompletionRequest
from mmserve.entrypoints.openai.streaming import ChatChoiceStream
from mmserve.frontend.chat_parsing import parse_messages
from mmserve.frontend.factory import build_frontend
from mmserve.frontend.media import MediaLoader
from mmserve.frontend.params import prepare_params
from mmserve.frontend.placeholders import expand_placeholders, pixel_handle
from mmserve.outputs import RequestOutputKind
from mmserve.protocol import EngineCoreOutput, EngineRequest, encode_add
from preprocess import hashing


class Stages:
    """CPU seconds (this thread's, so time the machine's other jobs take the core away is not
    counted) per stage of one pass over the rows."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def time(self, stage: str, fn: Callable, *args, **kwargs):
        t0 = time.thread_time()
        result = fn(*args, **kwargs)
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.thread_time() - t0
        return result


def one_request(frontend, body: bytes, output_ids: list[int], stages: Stages, index: int) -> None:
    """Every stage of one request, in the server's order."""
    tokenizer, inputs = frontend.tokenizer, frontend.inputs
    request = stages.time("json body", lambda: ChatCompletionRequest.model_validate(json.loads(body)))
    params = stages.time("sampling params", request.sampling_params, frontend.default_params)
    params = stages.time("sampling params", prepare_params, params, tokenizer)
    messages = stages.time("messages", prepare_messages, request.messages, None, False)
    template_messages, items = stages.time(
        "messages + data URL", parse_messages, messages, inputs.loader, inputs.image_limit, inputs.video_limit
    )
    pool = frontend.pool
    stages.time("mm hash", hashing.mm_hash, items[0], pool.settings)
    text = stages.time("chat template", inputs._render, template_messages, items, {})
    token_ids = stages.time("tokenise", inputs._encode, text)
    processed = stages.time("preprocess (workers)", lambda: [pool.process(item) for item in items])
    expanded, features, _videos = stages.time(
        "placeholders", expand_placeholders, token_ids, processed, inputs.processor
    )
    handles = {item.mm_hash: pixel_handle(item, 0) for item in processed}  # as sent: by handle
    for item in processed:
        item.release()
    engine_request = EngineRequest(
        request_id=f"r{index}",
        prompt_token_ids=expanded,
        mm_features=features,
        sampling_params=params,
        arrival_time=0.0,
        mm_handles=handles,
    )
    stages.time("engine request", encode_add, engine_request)
    stages.time("output per token", stream_outputs, frontend, f"r{index}", expanded, params, output_ids)


def stream_outputs(frontend, request_id: str, prompt_ids: list[int], params, output_ids: list[int]) -> None:
    """The output side of one streamed request: one engine output per token, detokenised,
    turned into chat chunks and SSE events."""
    outputs = frontend.outputs
    outputs.add_request(request_id, None, prompt_ids, params, RequestOutputKind.DELTA)
    choice = ChatChoiceStream(0, 0, parse_tools=False)
    base = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    for i, token in enumerate(output_ids):
        last = i == len(output_ids) - 1
        engine_output = EngineCoreOutput(request_id, [token], finish_reason="length" if last else None)
        results, _ = outputs.process_outputs([engine_output])
        for result in results:
            for completion in result.outputs:
                for entry in choice.chunks(completion):
                    sse({**base, "choices": [entry]})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    rows = sample_single_turn(load_conversations(args.dataset_path), args.num_prompts, args.seed)
    config = EngineArgs(
        model=args.model_dir, preprocess_workers=0, mm_processor_cache_gb=0
    ).create_engine_config()
    frontend = build_frontend(config, MediaLoader(), open_ended=True)
    bodies = [
        json.dumps(
            {
                "model": "m",
                "messages": [row.message()],
                "max_tokens": args.output_len,
                "stream": True,
                "temperature": 0,
            }
        ).encode()
        for row in rows
    ]
    # Output tokens that decode to ordinary text: the row's own prompt tokens, cycled.
    outputs = [
        (frontend.tokenizer.encode(row.prompt or "a") * args.output_len)[: args.output_len] for row in rows
    ]
    passes = []
    try:
        for _ in range(args.repeats + 1):  # the first pass warms caches and imports, not counted
            stages = Stages()
            for index, (body, output_ids) in enumerate(zip(bodies, outputs)):
                one_request(frontend, body, output_ids, stages, index)
            passes.append(stages.seconds)
    finally:
        frontend.close()
    report(passes[1:], len(rows), np.mean([len(b) for b in bodies]))
    return 0


def report(passes: list[dict[str, float]], num_requests: int, mean_body_bytes: float) -> None:
    print(
        f"{num_requests} requests, mean body {mean_body_bytes / 1024:.0f} KiB; "
        f"µs per request, median of {len(passes)} passes"
    )
    medians = {stage: statistics.median(p[stage] for p in passes) / num_requests * 1e6 for stage in passes[0]}
    in_server = sum(us for stage, us in medians.items() if stage != "preprocess (workers)")
    print(f"{'stage':<28}{'µs/request':>12}{'% of server':>13}")
    for stage, us in medians.items():
        share = "" if stage == "preprocess (workers)" else f"{100 * us / in_server:>12.1f}%"
        print(f"{stage:<28}{us:>12.0f}{share:>13}")
    print(f"{'API server total':<28}{in_server:>12.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
