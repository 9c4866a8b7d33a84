"""The pool: cache hits without IPC, shared computations, backpressure, worker deaths,
reference-counted segments, cross-process access and a clean close."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image
from preprocess_cases import (
    Processors,
    case_bytes,
    encode,
    reference,
    rgb_array,
    rgba_image,
)
from shm_peer import attach_and_inspect, exit_at_start

from preprocess import PreprocessPool, PreprocessPoolClosed, PreprocessWorkerDied, mm_hash
from preprocess.shm import list_segments, segment_size

MakePool = Callable[..., PreprocessPool]


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def slow_images(count: int) -> list[bytes]:
    """Distinct 3000×2250 JPEGs: each keeps a worker busy for tens of milliseconds at least."""
    base = rgb_array(3000, 2250)
    images = []
    for seed in range(count):
        base[:8, :8] = seed
        images.append(encode(Image.fromarray(base), "JPEG", quality=80))
    return images


def linked(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pool_output_equals_transformers(num_workers: int, make_pool: MakePool, processors: dict) -> None:
    tiny: Processors = processors["tiny"]
    pool = make_pool(num_workers=num_workers)
    for image in (
        case_bytes("jpeg_exif_orientation_6"),
        case_bytes("gif_animated_transparent"),
        rgba_image(90, 70),
    ):
        expected_pixels, expected_grid = reference(image, tiny.hf)
        with pool.process(image) as result:
            np.testing.assert_allclose(result.pixel_values, expected_pixels, rtol=0, atol=1e-6)
            assert result.grid_thw == tuple(expected_grid[0])
            assert result.num_tokens == expected_pixels.shape[0] // 4
            assert not result.pixel_values.flags.writeable


def test_cache_hit_returns_the_same_pixels_without_a_worker_round_trip(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=1)
    data = case_bytes("jpeg_640x480")
    first = pool.process(data)
    second = pool.process(data)
    third = asyncio.run(pool.process_async(data))
    stats = pool.stats()
    assert (stats.tasks_submitted, stats.cache_queries, stats.cache_hits) == (1, 3, 2)
    assert first.mm_hash == second.mm_hash == third.mm_hash == mm_hash(data, pool.settings)
    assert first.handle == second.handle == third.handle
    np.testing.assert_array_equal(first.pixel_values, third.pixel_values)
    for image in (first, second, third):
        image.release()


def test_concurrent_identical_requests_compute_once(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=1)
    data = case_bytes("jpeg_1024x768")

    async def burst() -> list:
        return await asyncio.gather(*(pool.process_async(data) for _ in range(8)))

    results = asyncio.run(burst())
    stats = pool.stats()
    assert (stats.tasks_submitted, stats.shared_computations, stats.cache_hits) == (1, 7, 0)
    assert len({r.handle.shm_name for r in results}) == 1
    for r in results:
        r.release()

    other = case_bytes("png_333x517")
    with ThreadPoolExecutor(8) as threads:
        results = list(threads.map(pool.process, [other] * 8))
    stats = pool.stats()
    assert stats.tasks_submitted == 2
    assert stats.shared_computations + stats.cache_hits == 7 + 7
    for r in results:
        r.release()


# A 56×56 image: grid (1, 4, 4), 16 rows of 3·14·14 floats (the frame once), in a segment rounded
# up to its size class.
SMALL_SEGMENT_BYTES = segment_size(16 * 588 * 4)


def test_lru_eviction_by_bytes_recomputes_the_evicted_image(make_pool: MakePool) -> None:
    one_image_bytes = SMALL_SEGMENT_BYTES
    pool = make_pool(num_workers=0, cache_bytes=2 * one_image_bytes)
    images = [encode(Image.fromarray(rgb_array(56, 56, seed)), "PNG") for seed in range(3)]
    for data in images:
        pool.process(data).release()
    assert (pool.stats().cached_images, pool.stats().cached_bytes) == (2, 2 * one_image_bytes)
    pool.process(images[2]).release()  # still cached
    assert pool.stats().tasks_submitted == 3
    pool.process(images[0]).release()  # evicted: computed again
    assert pool.stats().tasks_submitted == 4


def test_evicted_segment_is_unlinked_when_its_last_user_releases(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=0, cache_bytes=SMALL_SEGMENT_BYTES, spare_bytes=0)
    held = pool.process(encode(Image.fromarray(rgb_array(56, 56, 1)), "PNG"))
    released = pool.process(encode(Image.fromarray(rgb_array(56, 56, 2)), "PNG"))  # evicts `held`
    released_name = released.handle.shm_name
    released.release()
    assert linked(held.handle.shm_name)  # evicted but in use
    pool.process(encode(Image.fromarray(rgb_array(56, 56, 3)), "PNG")).release()  # evicts `released`
    assert not linked(released_name)  # evicted and unused: unlinked at once
    name = held.handle.shm_name
    held.release()
    assert not linked(name)


def test_freed_segment_is_recycled_for_the_next_image(make_pool: MakePool, processors: dict) -> None:
    pool = make_pool(num_workers=1, cache_bytes=0, spare_bytes=SMALL_SEGMENT_BYTES)
    first, second, third = (encode(Image.fromarray(rgb_array(56, 56, seed)), "PNG") for seed in range(3))
    with pool.process(first) as image:
        name = image.handle.shm_name
    assert linked(name) and pool.stats().spare_bytes == SMALL_SEGMENT_BYTES
    held = pool.process(second)
    assert held.handle.shm_name == name and pool.stats().spare_bytes == 0
    expected, _ = reference(second, processors["tiny"].hf)
    np.testing.assert_allclose(held.pixel_values, expected, rtol=0, atol=1e-6)
    with pool.process(third) as image:  # no spare left: a new segment
        other = image.handle.shm_name
    held.release()  # the spare budget is full: unlinked
    assert other != name and linked(other) and not linked(name)


def test_forgotten_image_is_released_by_garbage_collection(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=0, cache_bytes=0, spare_bytes=0)
    image = pool.process(case_bytes("png_56x56"))
    name = image.handle.shm_name
    assert linked(name)
    del image
    gc.collect()
    assert not linked(name)


def test_a_killed_worker_costs_no_request_its_image_is_retried_and_the_pool_heals(
    make_pool: MakePool,
) -> None:
    pool = make_pool(num_workers=2, cache_bytes=0)
    assert pool.wait_ready(60)
    victim, survivor = pool.worker_pids()
    batch = slow_images(6)

    async def run_batch_and_kill() -> list:
        requests = [asyncio.ensure_future(pool.process_async(data)) for data in batch]
        while pool.stats().tasks_submitted < 2:  # both workers hold a task now
            await asyncio.sleep(0.001)
        os.kill(victim, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), 60)

    results = asyncio.run(run_batch_and_kill())
    assert not [r for r in results if isinstance(r, Exception)], results
    for r in results:
        assert r.grid_thw == (1, 26, 36)
        r.release()
    assert pool.stats().tasks_submitted == 7  # the killed worker's image went out twice

    assert pool.wait_ready(60)
    pids = pool.worker_pids()
    assert victim not in pids and survivor in pids
    os.kill(survivor, signal.SIGKILL)  # an idle worker dying costs no request
    wait_until(lambda: survivor not in pool.worker_pids())
    assert pool.wait_ready(60)
    with pool.process(batch[0]) as again:
        assert again.grid_thw == (1, 26, 36)
    assert pool.stats().worker_restarts == 2


def test_an_image_whose_second_worker_dies_too_fails_with_the_worker_named(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=1, cache_bytes=0, spare_bytes=0)
    assert pool.wait_ready(60)
    [image] = slow_images(1)
    killed: list[int] = []

    async def process_and_kill_twice():
        request = asyncio.ensure_future(pool.process_async(image))
        for dispatches in (1, 2):
            while pool.stats().tasks_submitted < dispatches:  # the image is on a worker now
                await asyncio.sleep(0.001)
            [pid] = pool.worker_pids()
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
            while pid in pool.worker_pids():
                await asyncio.sleep(0.001)
        return await asyncio.wait_for(asyncio.gather(request, return_exceptions=True), 60)

    [error] = asyncio.run(process_and_kill_twice())
    assert isinstance(error, PreprocessWorkerDied), error
    expected = rf"preprocess worker 0 \(pid {killed[1]}\) died with exit code -9 \(SIGKILL\) "
    expected += "while processing image "
    assert re.fullmatch(expected + r"[0-9a-f]{32} \(its second try: it was retried once\)", str(error))
    assert list_segments(pool.segment_prefix) == []
    assert pool.wait_ready(60)
    with pool.process(image) as fine:  # the image itself is good: the pool is not poisoned
        assert fine.grid_thw == (1, 26, 36)


def test_workers_that_cannot_start_fail_requests_instead_of_hanging(
    make_pool: MakePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("preprocess.supervisor.worker_main", exit_at_start)
    pool = make_pool(num_workers=1)
    message = r"^preprocess workers keep dying at start-up \(the last one exited with exit code 3\)$"
    with ThreadPoolExecutor(1) as threads:
        request = threads.submit(pool.process, case_bytes("png_56x56"))
        with pytest.raises(PreprocessWorkerDied, match=message):
            request.result(60)
    with pytest.raises(PreprocessWorkerDied, match=message):  # and later ones fail at once
        pool.process(case_bytes("png_28x28"))
    assert not pool.wait_ready(0)


def test_backpressure_admits_at_most_max_pending(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=1, max_pending=1, cache_bytes=0)
    assert pool.wait_ready(60)
    slow, quick = slow_images(1)[0], case_bytes("png_56x56")

    async def scenario() -> None:
        first = asyncio.ensure_future(pool.process_async(slow))
        while pool.stats().pending == 0:
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(pool.process_async(quick))
        await asyncio.sleep(0.01)
        # Had the second request been admitted, it would be pending next to the first.
        assert not first.done() and pool.stats().pending == 1
        for image in await asyncio.gather(first, second):
            image.release()

    asyncio.run(scenario())
    assert pool.stats().tasks_submitted == 2


def test_cancelled_request_frees_its_result(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=1, cache_bytes=0, spare_bytes=0)

    async def scenario() -> None:
        request = asyncio.ensure_future(pool.process_async(slow_images(1)[0]))
        while pool.stats().pending == 0:
            await asyncio.sleep(0.001)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request

    asyncio.run(scenario())
    # The computation finishes in the background; nobody takes its result, so it is freed.
    wait_until(lambda: pool.stats().pending == 0 and list_segments(pool.segment_prefix) == [])
    assert pool.stats().tasks_submitted == 1


def test_another_process_attaches_read_only(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=1)
    with pool.process(case_bytes("jpeg_640x480")) as image:
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as other:
            total, writeable, write = other.submit(attach_and_inspect, image.handle).result(60)
        assert total == pytest.approx(float(image.pixel_values.astype(np.float64).sum()))
        assert not writeable and "read-only" in write
        assert linked(image.handle.shm_name)  # the other process's exit did not unlink it


def test_close_fails_unfinished_requests_and_unlinks_every_segment(make_pool: MakePool) -> None:
    pool = make_pool(num_workers=1)
    held = pool.process(case_bytes("png_56x56"))
    with ThreadPoolExecutor(1) as threads:
        unfinished = threads.submit(pool.process, slow_images(1)[0])
        wait_until(lambda: pool.stats().pending == 1)
        pool.close()
        with pytest.raises(PreprocessPoolClosed, match="closed before this image was processed"):
            unfinished.result(30)
    assert list_segments(pool.segment_prefix) == []
    assert held.pixel_values.shape == (16, 588)  # mapped memory outlives the name
    held.release()
    with pytest.raises(PreprocessPoolClosed, match="the preprocess pool is closed"):
        pool.process(case_bytes("png_56x56"))
