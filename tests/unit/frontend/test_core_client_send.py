"""Sending to EngineCore after it died: the frontend's PUSH socket holds a message whose only peer
is gone until a peer connects, which a dead engine never does, so a request whose send came just
after the death used to wait until the server's shutdown timeout cancelled it (a bare 500 after
8 s, tests/reliability/test_faults.py). A send now fails with EngineDeadError instead."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
import zmq

from mmserve.engine_args import EngineArgs
from mmserve.frontend.core_client import EngineDeadError, MPCoreClient
from mmserve.protocol import ADD, EngineRequest
from mmserve.sampling_params import SamplingParams
from mmserve.testing.checkpoints import checkpoint
from mmserve.testing.run_apart import run_apart


@pytest.fixture
def client():
    client = MPCoreClient(EngineArgs(checkpoint("qwen2_vl"), preprocess_workers=0).create_engine_config())
    yield client
    client.shutdown()


def exited_process() -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(target=int)
    process.start()
    process.join()
    return process


def test_a_send_with_the_engine_alive_and_connected_arrives(client):
    client.process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    client.process.start()
    peer = zmq.Context.instance().socket(zmq.PULL)
    peer.connect(client.input_address)
    try:
        run_apart(asyncio.wait_for(client.abort_requests(["r1"]), 5))
        assert peer.poll(5000)
        assert peer.recv_multipart()
    finally:
        peer.close(linger=0)


def test_a_send_after_the_engine_died_fails_instead_of_waiting(client):
    peer = zmq.Context.instance().socket(zmq.PULL)
    peer.connect(client.input_address)
    peer.close(linger=0)  # the engine's end of the socket is gone with it
    client.process = exited_process()

    with pytest.raises(EngineDeadError, match="exit code 0"):  # not wait_for's TimeoutError
        run_apart(asyncio.wait_for(client.abort_requests(["r1"]), 5))


def test_a_request_is_queued_before_the_send_first_awaits(client):
    """The frontend decides a request's pixel-store changes just before sending it: its message
    must take its place in the queue to the engine in that same event-loop turn, even when the
    queue is full and the send has to wait."""
    queued = []

    class FullSocket:
        def send_multipart(self, frames, copy=True):
            queued.append(frames)
            return asyncio.get_running_loop().create_future()  # no room yet

    async def first_turn() -> None:
        client._to_engine, real = FullSocket(), client._to_engine
        request = EngineRequest(
            request_id="r",
            prompt_token_ids=[1],
            mm_features=[],
            sampling_params=SamplingParams(),
            arrival_time=0,
        )
        sending = client.add_request(request)
        try:
            sending.send(None)  # runs up to its first suspension
            assert len(queued) == 1 and queued[0][0] == ADD
        finally:
            sending.close()
            client._to_engine = real

    run_apart(first_turn())
