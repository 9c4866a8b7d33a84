"""The executor's channel to its worker processes: one ZeroMQ PUB socket that broadcasts each
message once to every worker (the scheduler output of a step, a method call), and one PULL socket
that every worker's PUSH answers on, each message tagged with the sender's rank.

PUB/SUB drops what is published before a subscriber has joined, so the executor repeats a HELLO
until every rank has answered SUBSCRIBED (`ExecutorChannel.wait_subscribed`); after that no
message is lost (the send queue is unbounded: a slow worker delays, never drops, its steps).
Sockets are ipc:// in a private directory that the executor removes at shutdown.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

# executor → workers
HELLO, STEP, RPC, STOP = b"hello", b"step", b"rpc", b"stop"
# workers → executor
STARTED, FAILED, SUBSCRIBED, OUTPUT, REPLY, ERROR = (
    b"started",
    b"failed",
    b"subscribed",
    b"output",
    b"reply",
    b"error",
)

Message = tuple[int, bytes, bytes]  # (rank, kind, payload)


class ExecutorChannel:
    def __init__(self, directory: str) -> None:
        self.broadcast_address = f"ipc://{directory}/broadcast"
        self.result_address = f"ipc://{directory}/results"
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.bind(self.broadcast_address)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self.result_address)

    def publish(self, kind: bytes, payload: bytes = b"") -> int:
        """Send one message to every subscribed worker; returns the bytes sent (kind + payload)."""
        self._pub.send_multipart([kind, payload], copy=False)
        return len(kind) + len(payload)

    def receive(self, timeout_ms: int) -> Message | None:
        """The next worker message, or None when none came within `timeout_ms`."""
        if not self._pull.poll(timeout_ms):
            return None
        rank, kind, payload = self._pull.recv_multipart()
        return int(rank), kind, payload

    def wait_subscribed(self, world_size: int, check: Callable[[], None], timeout_s: float) -> None:
        """Publish HELLO until every rank has answered; `check` raises if a worker died."""
        joined: set[int] = set()
        for _ in range(max(1, int(timeout_s / 0.05))):
            self.publish(HELLO)
            message = self.receive(50)
            while message is not None:
                rank, kind, payload = message
                if kind != SUBSCRIBED:
                    raise RuntimeError(f"worker {rank} sent {kind!r} before subscribing: {payload[:200]!r}")
                joined.add(rank)
                message = self.receive(0)
            if len(joined) == world_size:
                return
            check()
        raise TimeoutError(f"only workers {sorted(joined)} of {world_size} subscribed within {timeout_s} s")

    def close(self) -> None:
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()


class WorkerChannel:
    """A worker's end: the broadcasts in, its tagged answers out."""

    def __init__(self, broadcast_address: str, result_address: str, rank: int) -> None:
        self._rank = str(rank).encode()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(broadcast_address)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(result_address)

    def receive(self) -> tuple[bytes, bytes]:
        kind, payload = self._sub.recv_multipart()
        return kind, payload

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        self._push.send_multipart([self._rank, kind, payload], copy=False)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._push.close(linger=1000)
        self._ctx.term()
