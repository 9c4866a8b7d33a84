"""The whole engine (scheduler, KV cache, encoder cache, runner, frontend) through `LLM.chat`,
token for token against transformers on the same folder, in float32."""

from __future__ import annotations

import pytest
from engine_cases import MAX_TOKENS, conversation, data_url, expected_tokens

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import Reference, synthetic_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(model_dir) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, dtype="float32", max_num_batched_tokens=32, num_kv_blocks=1024) as engine:
        yield engine


def test_sixteen_concurrent_mixed_chats_match_transformers(llm, reference):
    convs = [conversation(i, num_images=i % 3) for i in range(16)]
    outputs = llm.chat([c[0] for c in convs], GREEDY)
    for (_, ref_messages, images), out in zip(convs, outputs):
        prompt_ids, tokens = expected_tokens(reference, ref_messages, images)
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
        assert out.outputs[0].text == reference.tokenizer.decode(tokens, skip_special_tokens=True)


def test_second_turn_reuses_the_first_turn_from_the_prefix_cache(llm, reference):
    messages, ref_messages, images = conversation(40, num_images=1)
    [first] = llm.chat(messages, GREEDY)
    before = llm.stats()
    follow_up = [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "And what else do you see?"},
    ]
    [second] = llm.chat(messages + follow_up, GREEDY)
    after = llm.stats()
    assert second.num_cached_tokens >= 32
    assert after.prefix_cache_hits - before.prefix_cache_hits == second.num_cached_tokens
    assert after.encoder_runs == before.encoder_runs, "the image's tokens all came from the prefix cache"
    _, tokens = expected_tokens(reference, ref_messages + follow_up, images)
    assert second.outputs[0].token_ids == tokens


def test_preemption_returns_the_same_tokens(model_dir, reference):
    convs = [conversation(i, num_images=i % 2) for i in range(8)]
    with LLM(model_dir, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=24, block_size=16) as small:
        outputs = small.chat([c[0] for c in convs], SamplingParams(temperature=0.0, max_tokens=24))
        assert small.stats().num_preemptions > 0
        assert small.stats().kv_blocks_in_use == 0
    for (_, ref_messages, images), out in zip(convs, outputs):
        _, tokens = expected_tokens(reference, ref_messages, images, max_tokens=24)
        assert out.outputs[0].token_ids == tokens


def test_seeded_n2_sampling_is_reproducible_across_runs_and_batches(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, n=2, seed=7, max_tokens=12)
    messages = conversation(3, num_images=1)[0]
    [alone] = llm.chat(messages, params)
    others = [conversation(i, num_images=i % 3)[0] for i in range(5)]
    crowd = llm.chat([*others[:2], messages, *others[2:]], [GREEDY, params, params, GREEDY, params, GREEDY])
    [again] = llm.chat(messages, params)
    samples = [o.token_ids for o in alone.outputs]
    assert len(samples) == 2 and samples[0] != samples[1]
    assert [o.token_ids for o in crowd[2].outputs] == samples
    assert [o.token_ids for o in again.outputs] == samples


def test_encoder_runs_once_per_distinct_image_and_not_for_a_cached_image(llm):
    runner = llm.engine_core.executor.runner
    a, b = synthetic_image(224, 168, seed=901), synthetic_image(168, 224, seed=902)
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(b)}},
        {"type": "text", "text": "and again"},
        {"type": "image_url", "image_url": {"url": data_url(a)}},
    ]
    runs, calls = llm.stats().encoder_runs, runner.num_encoder_calls
    llm.chat([{"role": "user", "content": parts}], GREEDY)  # 3 images over ~10 chunks of 32 tokens
    assert llm.stats().encoder_runs - runs == 2
    assert runner.num_encoder_calls - calls == 2
    # Another conversation (different system prompt: no prefix hit) with image b while it is cached.
    hits = llm.stats().encoder_cache_hits
    llm.chat(
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": [parts[2], {"type": "text", "text": "What is it?"}]},
        ],
        GREEDY,
    )
    assert llm.stats().encoder_runs - runs == 2
    assert runner.num_encoder_calls - calls == 2
    assert llm.stats().encoder_cache_hits == hits + 1


def test_generate_accepts_token_ids_and_pil_images(llm, reference):
    image = synthetic_image(180, 180, seed=5)
    ref_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = reference.tokenizer.apply_chat_template(ref_messages, tokenize=False, add_generation_prompt=True)
    [by_text] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
    prompt_ids, tokens = expected_tokens(reference, ref_messages, [image])
    assert by_text.prompt_token_ids == prompt_ids
    assert by_text.outputs[0].token_ids == tokens
    [by_ids] = llm.generate(
        {"prompt_token_ids": reference.tokenizer(text)["input_ids"], "multi_modal_data": {"image": image}},
        GREEDY,
    )
    assert by_ids.outputs[0].token_ids == tokens
