"""Admission gate: FIFO slots shared by threads and asyncio, cancellation and close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from preprocess.errors import PreprocessPoolClosed
from preprocess.gate import AdmissionGate


def test_blocking_waiter_gets_the_slot_a_release_frees() -> None:
    gate = AdmissionGate(1)
    gate.acquire()
    entered = threading.Event()
    waiter = threading.Thread(target=lambda: (gate.acquire(), entered.set()))
    waiter.start()
    assert not entered.wait(0.05)  # blocked: no slot
    gate.release()
    assert entered.wait(5)
    waiter.join()


def test_waiters_are_served_in_arrival_order_across_both_apis() -> None:
    gate = AdmissionGate(1)
    gate.acquire()
    order: list[str] = []

    async def scenario() -> None:
        async def async_waiter(name: str) -> None:
            await gate.acquire_async()
            order.append(name)

        first = asyncio.ensure_future(async_waiter("async-1"))
        await asyncio.sleep(0.01)
        thread = threading.Thread(target=lambda: (gate.acquire(), order.append("thread-2")))
        thread.start()
        await asyncio.sleep(0.05)
        gate.release()  # -> async-1
        await first
        gate.release()  # -> thread-2
        await asyncio.to_thread(thread.join)

    asyncio.run(scenario())
    assert order == ["async-1", "thread-2"]


def test_cancelled_async_waiter_neither_keeps_nor_loses_a_slot() -> None:
    gate = AdmissionGate(1)

    async def scenario() -> None:
        await gate.acquire_async()
        waiter = asyncio.ensure_future(gate.acquire_async())
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.release()
        await asyncio.wait_for(gate.acquire_async(), 1)  # the slot came back

    asyncio.run(scenario())


def test_close_fails_every_waiter_and_later_entries() -> None:
    gate = AdmissionGate(1)
    gate.acquire()
    errors: list[Exception] = []

    def wait() -> None:
        try:
            gate.acquire()
        except PreprocessPoolClosed as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.05)
    gate.close()
    thread.join(5)
    assert [str(e) for e in errors] == ["the preprocess pool was closed while waiting"]
    with pytest.raises(PreprocessPoolClosed, match="the preprocess pool is closed"):
        gate.acquire()
