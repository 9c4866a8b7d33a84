"""The frontend's mirror of EngineCore's pixel store and the store itself never disagree.

1,000 seeded random sequences drive the real frontend (MediaProcessor and its mirror, a real
preprocess pool in this process, handles in shared memory or copied pixels), the real wire
format (encode/decode of every message) and the real EngineCore (scheduler, encoder cache,
pixel store) with a fake runner, through new images, repeats, prompts built and sent later or
dropped, n > 1, sends that fail, aborts, preemptions (a tiny KV cache) and evictions (a tiny
store and encoder cache). After every message the mirror lists exactly the store's keys (and
bytes); no request fails; every item encoded is encoded from its own pixels; every answer is
the oracle's; at the end no pin, hold or segment is left.

MMSERVE_LOCKSTEP_SEQUENCES sets the number of sequences (default 1000).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
from fake_runner import FakeRunner, expected_output

from mmserve import protocol
from mmserve.config import CacheConfig, SchedulerConfig
from mmserve.core import pixel_store
from mmserve.core.engine_core import EngineCore
from mmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from mmserve.core.scheduler import Scheduler
from mmserve.frontend.media_processor import MediaProcessor
from mmserve.frontend.pixel_store_mirror import PixelStoreMirror
from mmserve.frontend.placeholders import expand_placeholders
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.models.family import Expansion, MultiModalProcessor, Placement, ProcessedItem
from mmserve.sampling_params import SamplingParams
from mmserve.testing.reference import png_bytes, synthetic_image
from preprocess import PreprocessPool
from preprocess.hashing import pixels_digest
from preprocess.qwen_vl import QwenVLImageSettings

SEQUENCES = int(os.environ.get("MMSERVE_LOCKSTEP_SEQUENCES", "1000"))
IMAGE_PAD = 100  # the fake model's placeholder token
SIZES = [(56, 56), (84, 56), (56, 84), (112, 84), (84, 84), (56, 112), (112, 56)]  # 4 to 12 tokens
MAX_MODEL_LEN = 128
BLOCK_SIZE = 4


class PadProcessor(MultiModalProcessor):
    """The fake model's layout: each image placeholder becomes one pad per token."""

    image_settings = QwenVLImageSettings()
    video_settings = None
    image_placeholder, image_placeholder_id = "<pad>", IMAGE_PAD
    video_placeholder = video_placeholder_id = None

    def expand_image(self, item: ProcessedItem) -> Expansion:
        return Expansion([IMAGE_PAD] * item.num_tokens, [Placement(0, item.num_tokens, item.grid_thw)])

    def expand_video(self, item: ProcessedItem) -> Expansion:
        raise AssertionError("no videos here")


@pytest.fixture(scope="module")
def universe():
    """(the pool, the images' bytes, mm_hash → digest of its pixels)."""
    pool = PreprocessPool(QwenVLImageSettings(), num_workers=0)
    images = [png_bytes(synthetic_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    digests = {}
    for data in images:
        with pool.process(data) as processed:
            digests[processed.mm_hash] = processed.digest
    yield pool, images, digests
    pool.close()


class CheckingRunner(FakeRunner):
    """The fake runner, checking that each item it encodes comes with its own pixels."""

    def __init__(self, digests: dict[str, int]) -> None:
        super().__init__(BLOCK_SIZE)
        self.digests = digests

    def execute_model(self, scheduler_output: SchedulerOutput, fail: bool = False) -> ModelRunnerOutput:
        for mm_hash, pixels in scheduler_output.encoder_pixels.items():
            assert pixels_digest(pixels) == self.digests[mm_hash], f"{mm_hash} encoded from other pixels"
        output = super().execute_model(scheduler_output, fail)
        step = self.num_steps - 1
        encoded = set()
        for encode_step, _, mm_hash in reversed(self.encodes):
            if encode_step != step:
                break
            encoded.add(mm_hash)
        assert set(scheduler_output.encoder_pixels) == encoded, "pixels exactly for the items encoded"
        return output

    def shutdown(self) -> None:
        pass


@dataclass
class Sent:
    prompt: list[int]
    features: list
    params: SamplingParams
    aborted: bool = False


@dataclass
class Sequence:
    """One random sequence: a frontend and an engine, driven message by message."""

    seed: int
    pool: PreprocessPool
    images: list[bytes]
    digests: dict[str, int]
    rng: random.Random = field(init=False)
    built: list[tuple[ProcessedPrompt, int]] = field(default_factory=list)  # (prompt, n) not sent yet
    sent: dict[str, Sent] = field(default_factory=dict)  # engine request id → what it was
    finished: dict[str, tuple[list[int], str | None, str | None]] = field(default_factory=dict)
    next_id: int = 0
    num_messages: int = 0
    num_not_sent: int = 0

    def __post_init__(self) -> None:
        rng = self.rng = random.Random(self.seed)
        capacity = rng.choice([0, 40_000, 120_000, 300_000, 1 << 30])  # one image is 38-113 kB
        self.media = MediaProcessor(self.pool, pixel_store_bytes=capacity)
        encoder_cache = rng.choice([12, 16, 24, 48])  # embeddings: one to a few images
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=rng.choice([2, 4, 8]),
                max_num_batched_tokens=rng.choice([16, 32, 64]),
                max_model_len=MAX_MODEL_LEN,
            ),
            CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=rng.random() < 0.5),
            num_blocks=rng.randint(15, 24),  # the longest request needs 15: preemptions
            encoder_budget=12,
            encoder_cache_size=encoder_cache,
        )
        self.engine = EngineCore(scheduler, CheckingRunner(self.digests))

    # ------------------------------------------------------------------ operations

    def run(self, num_ops: int) -> None:
        operations = [
            self.build,
            self.build,
            self.send,
            self.send,
            self.step,
            self.step,
            self.abort,
            self.drop,
        ]
        for _ in range(num_ops):
            self.rng.choice(operations)()
        while self.built:
            self.send()
        for _ in range(2000):
            if not self.engine.has_work():
                break
            self.step()
        self.check_end()

    def build(self) -> None:
        rng = self.rng
        chosen = [rng.choice(self.images) for _ in range(rng.choice([0, 1, 1, 2, 3]))]
        processed, holds = self.media.process_all(chosen)
        token_ids = [rng.randint(2, 60) for _ in range(rng.randint(1, 4))]
        for _ in chosen:
            token_ids += [IMAGE_PAD] + [rng.randint(2, 60) for _ in range(rng.randint(0, 3))]
        expanded, features, arrays = expand_placeholders(token_ids, processed, PadProcessor())
        prompt = ProcessedPrompt.from_processed(None, expanded, features, arrays, processed, holds)
        self.built.append((prompt, rng.choice([1, 1, 1, 2])))

    def send(self) -> None:
        if not self.built:
            return self.build()
        prompt, n = self.built.pop(self.rng.randrange(len(self.built)))
        params = SamplingParams(temperature=0, max_tokens=self.rng.randint(1, 10), eos_token_ids=[])
        try:
            for _ in range(n):
                self.media.by_handle = self.rng.random() < 0.7
                request_id = f"r{self.next_id}"
                self.next_id += 1
                request = self.media.engine_request(prompt, request_id, params, 0.0)
                if self.rng.random() < 0.05:  # the send fails: nothing reaches the engine
                    self.media.not_sent(request)
                    self.num_not_sent += 1
                    self.check_lockstep()
                    return
                frames = protocol.encode_add(request)
                self.engine.add_request(protocol.decode_add([bytes(memoryview(f)) for f in frames]))
                self.sent[request_id] = Sent(prompt.token_ids, prompt.features, params)
                self.num_messages += 1
                self.check_lockstep()
        finally:
            prompt.release()

    def step(self) -> None:
        for _ in range(self.rng.randint(1, 2)):
            if not self.engine.has_work():
                return
            outputs = protocol.decode_outputs(protocol.encode_outputs(self.engine.step()))
            self.media.apply_engine_outputs(outputs)
            for output in outputs.outputs:
                tokens, _, _ = self.finished.get(output.request_id, ([], None, None))
                self.finished[output.request_id] = (
                    tokens + output.new_token_ids,
                    output.finish_reason,
                    output.error,
                )
                assert output.finish_reason != "error", f"{output.request_id}: {output.error}"

    def abort(self) -> None:
        running = [
            r for r, s in self.sent.items() if not s.aborted and self.finished.get(r, (0, None))[1] is None
        ]
        if running:
            request_id = self.rng.choice(running)
            self.sent[request_id].aborted = True
            self.engine.abort_requests(protocol.decode_abort(protocol.encode_abort([request_id])))

    def drop(self) -> None:
        """A prompt built and never sent (its client left)."""
        if self.built:
            prompt, _ = self.built.pop(self.rng.randrange(len(self.built)))
            prompt.release()

    # ------------------------------------------------------------------ checks

    def check_lockstep(self) -> None:
        mirror, store = self.media.mirror, self.engine.pixel_store
        assert mirror.engine_keys() == store.keys(), f"after message {self.num_messages}"
        listed = [pixels for mm_hash, pixels in store._pixels.items() if mm_hash in mirror]
        assert mirror.nbytes == sum(pixels.nbytes for pixels in listed), "the same bytes"

    def check_end(self) -> None:
        self.check_lockstep()
        for request_id, sent in self.sent.items():
            tokens, reason, error = self.finished[request_id]
            assert error is None, f"{request_id}: {error}"
            if sent.aborted and reason == "abort":
                continue
            expected = expected_output(sent.prompt, sent.features, sent.params, MAX_MODEL_LEN)
            assert (tokens, reason) == expected, request_id
        scheduler = self.engine.scheduler
        assert not scheduler.requests and scheduler.kv.num_used_blocks == 0
        assert scheduler.encoder_cache_manager.num_references() == 0
        assert self.pool.stats().pinned == 0, "every handle sent was reported read"
        assert self.media.mirror.num_held() == 0, "every prompt gave its holds back"
        assert self.pool.segments_in_use() == [], "no segment outside the pool's cache"


def run_sequences(universe, count: int, first_seed: int = 0) -> dict[str, int]:
    pool, images, digests = universe
    totals = dict.fromkeys(
        ["messages", "by_hash", "evicted", "preemptions", "encoder_runs", "aborts", "not_sent"], 0
    )
    for seed in range(first_seed, first_seed + count):
        sequence = Sequence(seed, pool, images, digests)
        try:
            sequence.run(num_ops=random.Random(seed).randint(10, 60))
        except AssertionError as e:
            raise AssertionError(f"sequence {seed}: {e}") from e
        mirror = sequence.media.mirror
        totals["messages"] += sequence.num_messages
        totals["by_hash"] += mirror.images_by_hash
        totals["evicted"] += mirror.images_by_handle + mirror.images_with_pixels - len(mirror.engine_keys())
        totals["preemptions"] += sequence.engine.scheduler.num_preemptions
        totals["encoder_runs"] += sequence.engine.scheduler.num_encoder_runs
        totals["aborts"] += sum(sent.aborted for sent in sequence.sent.values())
        totals["not_sent"] += sequence.num_not_sent
    return totals


def test_the_mirror_and_the_engines_pixel_store_never_disagree(universe):
    totals = run_sequences(universe, SEQUENCES)
    print(f"{SEQUENCES} sequences: {totals}")
    assert all(count > SEQUENCES // 10 for count in totals.values()), f"every path taken often: {totals}"


def test_the_check_catches_an_engine_that_skips_an_eviction(universe, monkeypatch):
    apply = pixel_store.PixelStore.apply

    def apply_but_keep_one(self, request):
        if request.mm_evict:
            request.mm_evict = request.mm_evict[1:]
        return apply(self, request)

    monkeypatch.setattr(pixel_store.PixelStore, "apply", apply_but_keep_one)
    with pytest.raises(AssertionError, match="after message"):
        run_sequences(universe, 50)


def test_the_check_catches_a_mirror_that_evicts_what_a_prompt_holds(universe, monkeypatch):
    """Without holds an entry can be evicted between a prompt's build and its send (the engine
    then lacks an item sent by hash), or by the very request that brings it."""
    monkeypatch.setattr(PixelStoreMirror, "_hold", lambda self, mm_hash, holds: None)
    with pytest.raises(AssertionError, match=r"after message|internal error"):
        run_sequences(universe, 50)
