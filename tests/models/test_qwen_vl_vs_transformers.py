"""Our Qwen2-VL / Qwen2.5-VL on a paged KV cache against transformers on the same folder.

Every case: 32 greedy tokens identical to transformers `generate` in float32, and the
log-probabilities we report within 1e-4 (relative to their scale) of transformers' logits.
"""

from __future__ import annotations

import pytest
import torch

from mmserve.config import CacheConfig, ExecutionConfig, SchedulerConfig
from mmserve.layers.fused_decoder_layer import FusedDecoderLayer
from mmserve.models.registry import load_model_config
from mmserve.testing.driver import ChunkedDriver
from mmserve.testing.reference import PromptInputs, Reference, synthetic_image
from mmserve.worker.model_runner import ModelRunner

MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module", params=["torch", "cpu"])
def runner(model_dir, request) -> ModelRunner:
    """The runner on the torch reference kernels and on the C++ kernels (fused layers)."""
    config = load_model_config(model_dir, dtype="float32")
    runner = ModelRunner(
        config,
        CacheConfig(block_size=16),
        SchedulerConfig(max_num_seqs=8),
        torch.device("cpu"),
        ExecutionConfig(attention_backend=request.param),
    )
    runner.initialize_kv_cache(num_blocks=1024)
    layers = list(runner.model.language_model.layers)
    # the C++ kernels run each decoder layer as one call (tests/models/test_fused_decoder_layer.py)
    assert layers and all(
        isinstance(layer, FusedDecoderLayer) == (request.param == "cpu") for layer in layers
    )
    return runner


def user(*parts) -> list[dict]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


IMG = None  # marks an image part in `user(...)`

CASES = {
    "one_image": (user(IMG, "What colour is the circle?"), [(168, 112)]),
    "two_images": (user(IMG, "Compare this picture", IMG, "with that one."), [(200, 150), (84, 300)]),
    "image_at_start": (user(IMG, "Describe the image in detail, please."), [(224, 224)]),
    "image_in_middle": (user("Look at this:", IMG, "How many shapes are there?"), [(300, 200)]),
    "image_at_end": (user("Here is my picture, tell me about it.", IMG), [(140, 420)]),
    "text_only": (user("Hello! Write a short story about a red square and a blue circle."), []),
}


def build(reference: Reference, name: str, seed: int = 0) -> PromptInputs:
    messages, sizes = CASES[name]
    images = [synthetic_image(w, h, seed=seed + i) for i, (w, h) in enumerate(sizes)]
    return reference.build_prompt(messages, images)


def assert_matches(reference: Reference, prompt: PromptInputs, ours) -> None:
    expected = reference.generate(prompt, MAX_NEW_TOKENS)
    assert ours.output[: len(expected.token_ids)] == expected.token_ids
    ref_logprobs = torch.log_softmax(expected.logits, dim=-1)
    for step, lists in enumerate(ours.logprobs[: len(expected.token_ids)]):
        ids = torch.tensor(lists.token_ids[0])
        got = torch.tensor(lists.logprobs[0])
        want = ref_logprobs[step, ids]
        scale = ref_logprobs[step].abs().max()
        assert ((got - want).abs().max() / scale).item() < 1e-4, f"step {step}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_single_prompt_matches_transformers(reference, runner, case):
    prompt = build(reference, case)
    [ours] = ChunkedDriver(runner).generate([prompt], MAX_NEW_TOKENS, chunk_size=4096)
    assert_matches(reference, prompt, ours)


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_chunked_prefill_through_images_matches_transformers(reference, runner, chunk_size):
    prompt = build(reference, "two_images", seed=3)
    starts = [offset for offset, _ in prompt.image_spans]
    ends = [offset + length for offset, length in prompt.image_spans]
    boundaries = range(chunk_size, len(prompt.token_ids), chunk_size)
    assert any(s < b < e for b in boundaries for s, e in zip(starts, ends)), (
        "no chunk boundary inside an image"
    )
    [ours] = ChunkedDriver(runner).generate([prompt], MAX_NEW_TOKENS, chunk_size=chunk_size)
    assert_matches(reference, prompt, ours)


def test_batch_of_four_prompts_in_one_forward(reference, runner):
    names = ["one_image", "text_only", "two_images", "image_in_middle"]
    prompts = [build(reference, name, seed=10 + i) for i, name in enumerate(names)]
    driver = ChunkedDriver(runner)
    outputs = driver.generate(prompts, MAX_NEW_TOKENS, chunk_size=4096)
    for prompt, ours in zip(prompts, outputs):
        assert_matches(reference, prompt, ours)
