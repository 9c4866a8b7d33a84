"""Images the engine's pixel store holds are sent by hash: answers are token for token the same
as with pixels, the frontend neither decodes, preprocesses nor copies them (the pool's and the
mirror's counters). An image whose embeddings the engine evicted is encoded again from its
stored pixels (nothing is asked of the frontend); one the mirror evicted from the store is sent
with its pixels again. The mirror and the store always list the same images."""

from __future__ import annotations

import base64

import pytest
from engine_cases import data_url

from mmserve.entrypoints.llm import LLM
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.reference import png_bytes, synthetic_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def chat(url: str, question: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module", params=[False, True], ids=["no-prefix-cache", "prefix-cache"])
def llm(request):
    engine = LLM(
        checkpoint("qwen2_vl"),
        dtype="float32",
        max_num_batched_tokens=64,
        num_kv_blocks=256,
        enable_prefix_caching=request.param,
    )
    with engine:
        yield engine


def data_url_of(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def tokens(outputs) -> list[int]:
    [output] = outputs
    return output.outputs[0].token_ids


def test_a_repeated_data_url_is_sent_by_hash_with_the_same_answer(llm):
    url = data_url(synthetic_image(200, 150, seed=11))
    first = tokens(llm.chat(chat(url), GREEDY))
    pool, mirror = llm._frontend.pool, llm._inputs.media.mirror
    pool_before, copies_before, by_hash_before = (
        pool.stats(),
        mirror.images_with_pixels,
        mirror.images_by_hash,
    )
    again = tokens(llm.chat(chat(url), GREEDY))
    assert again == first
    pool_after = pool.stats()
    assert pool_after.cache_queries == pool_before.cache_queries, "the pool was not even asked"
    assert pool_after.tasks_submitted == pool_before.tasks_submitted, "nothing decoded or preprocessed"
    assert mirror.images_with_pixels == copies_before, "no pixel copy"
    assert mirror.images_by_hash == by_hash_before + 1
    assert_in_lockstep(llm)


def assert_in_lockstep(llm) -> None:
    assert llm._inputs.media.mirror.engine_keys() == llm.engine_core.pixel_store.keys()


def test_embeddings_evicted_after_the_prompt_was_built_are_encoded_again_from_the_store(llm):
    url = data_url(synthetic_image(160, 120, seed=12))
    question = "Describe the colours."
    first = tokens(llm.chat(chat(url, question), GREEDY))
    prompt = llm._inputs.chat(chat(url, question))  # the mirror lists it: by hash
    [feature] = prompt.features
    assert prompt.shared == {}, "no pixels in the prompt"
    cache = llm.engine_core.scheduler.encoder_cache_manager
    cache.discard(feature.mm_hash)  # the engine drops the embeddings before the request is scheduled
    if llm.config.cache.enable_prefix_caching:
        llm.engine_core.scheduler.kv.reset_prefix_cache()
    pool, mirror = llm._frontend.pool, llm._inputs.media.mirror
    queries, by_hash, runs = pool.stats().cache_queries, mirror.images_by_hash, llm.stats().encoder_runs
    [output] = llm._run([prompt], GREEDY)
    assert output.outputs[0].token_ids == first
    assert mirror.images_by_hash == by_hash + 1 and pool.stats().cache_queries == queries, "nothing resent"
    assert llm.stats().encoder_runs == runs + 1
    assert llm.stats().encoder_cache_references == 0
    assert_in_lockstep(llm)


def test_an_image_the_mirror_evicted_from_the_store_is_sent_again_with_its_pixels(llm):
    mirror = llm._inputs.media.mirror
    urls = [data_url(synthetic_image(112, 84, seed=seed)) for seed in (15, 16)]
    capacity = mirror.capacity_bytes
    mirror.capacity_bytes = 1  # the store keeps the last request's image only
    try:
        first = tokens(llm.chat(chat(urls[0]), GREEDY))
        llm.chat(chat(urls[1]), GREEDY)  # evicts the first from both
        assert_in_lockstep(llm)
        assert len(llm.engine_core.pixel_store) == 1
        handles = mirror.images_by_handle
        assert tokens(llm.chat(chat(urls[0]), GREEDY)) == first
        assert mirror.images_by_handle == handles + 1, "its pixels went again"
        assert_in_lockstep(llm)
    finally:
        mirror.capacity_bytes = capacity


def test_a_pil_image_and_its_png_give_the_same_answer_after_the_png_is_cached(llm):
    image = synthetic_image(128, 96, seed=13)
    url = data_url(image)
    from_url = tokens(llm.chat(chat(url), GREEDY))
    again = tokens(llm.chat(chat(url), GREEDY))  # by hash now
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "What is in the picture?"}]
    from_pil = tokens(llm.chat([{"role": "user", "content": parts}], GREEDY))
    assert from_url == again == from_pil


def test_an_uploaded_image_id_answers_as_its_bytes_offline(llm):
    data = png_bytes(synthetic_image(144, 112, seed=14))
    file_id = llm.upload_image(data)
    by_id = [{"type": "image_file", "image_file": {"file_id": file_id}}, {"type": "text", "text": "Hi?"}]
    by_url = [{"type": "image_url", "image_url": {"url": data_url_of(data)}}, {"type": "text", "text": "Hi?"}]
    first = tokens(llm.chat([{"role": "user", "content": by_id}], GREEDY))
    assert tokens(llm.chat([{"role": "user", "content": by_url}], GREEDY)) == first
    assert tokens(llm.chat([{"role": "user", "content": by_id}], GREEDY)) == first
