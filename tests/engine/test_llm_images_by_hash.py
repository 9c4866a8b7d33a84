"""Images the engine already holds are sent by hash: answers are token for token the same as
with pixels, the frontend neither decodes, preprocesses nor copies them (the pool's and the
mirror's counters), and an image the engine evicts between the mirror check and scheduling is
sent again when the engine asks, with the same answer."""

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


def test_an_image_evicted_between_the_mirror_check_and_scheduling_is_sent_again(llm):
    url = data_url(synthetic_image(160, 120, seed=12))
    question = "Describe the colours."
    first = tokens(llm.chat(chat(url, question), GREEDY))
    prompt = llm._inputs.chat(chat(url, question))  # the mirror check: the engine holds it
    [feature] = prompt.features
    assert feature.by_hash and feature.pixel_values is None
    cache = llm.engine_core.scheduler.encoder_cache_manager
    cache.discard(feature.mm_hash)  # the engine drops it before the request is scheduled
    if llm.config.cache.enable_prefix_caching:
        llm.engine_core.scheduler.kv.reset_prefix_cache()
    resent, runs = llm._inputs.media.mirror.pixels_resent, llm.stats().encoder_runs
    [output] = llm._run([prompt], GREEDY)
    assert output.outputs[0].token_ids == first
    assert llm._inputs.media.mirror.pixels_resent == resent + 1, "the engine asked for the pixels once"
    assert llm.stats().encoder_runs == runs + 1
    assert llm.stats().encoder_cache_references == 0


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
