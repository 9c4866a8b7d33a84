"""A model step that raises, inside the real runner, fails only the request that causes it: its
batch-mates (text and images, split across steps) finish with exactly the tokens they get
without the fault, and the engine keeps serving with nothing left held."""

from __future__ import annotations

import base64

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import png_bytes, synthetic_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
POISON_TEXT = "Zanzibar quokka marmalade"


def chat(text: str, image_seed: int | None) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": text}]
    if image_seed is not None:
        png = png_bytes(synthetic_image(180, 140, image_seed))
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        parts.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": parts}]


def inject_fault(llm: LLM, marker: list[int]) -> list[int]:
    """Make the runner raise after it has updated its state and run the vision tower, in any step
    that includes a request whose prompt contains `marker`. Returns the per-step sizes seen."""
    runner = llm.engine_core.executor.runner
    real_execute, real_embed = runner.execute_model, runner._embed
    current: list[str] = []
    sizes: list[int] = []

    def execute_model(so):
        current[:] = so.num_scheduled_tokens
        sizes.append(len(current))
        return real_execute(so)

    def is_poison(req_id: str) -> bool:
        ids = runner.batch.states[req_id].prompt_token_ids
        return any(ids[i : i + len(marker)] == marker for i in range(len(ids)))

    def embed(inputs):
        if any(is_poison(r) for r in current):
            raise RuntimeError("injected fault")
        return real_embed(inputs)

    runner.execute_model = execute_model
    runner._embed = embed
    return sizes


def test_only_the_faulty_request_fails_and_its_batch_mates_are_unchanged(model_dir):
    mates = [chat("Describe the image.", 1), chat("Hello, how are you?", None), chat("What is here?", 2)]
    with LLM(model_dir, dtype="float32", max_num_batched_tokens=48, num_kv_blocks=256) as llm:
        want = [o.outputs[0].text for o in llm.chat(mates, GREEDY)]
        marker = llm.get_tokenizer().encode(" quokka marmalade")[:2]
        sizes = inject_fault(llm, marker)
        outs = llm.chat([mates[0], chat(POISON_TEXT, 3), mates[1], mates[2]], GREEDY)
        assert outs[1].outputs[0].finish_reason == "error", outs[1]
        assert "internal error" in outs[1].error
        assert [outs[i].outputs[0].text for i in (0, 2, 3)] == want
        assert max(sizes) > 1  # the poison did share steps with the others before it was isolated
        stats = llm.stats()
        assert stats.kv_blocks_in_use == 0 and stats.encoder_cache_references == 0
        assert [o.outputs[0].text for o in llm.chat(mates, GREEDY)] == want
