"""How the scheduler talks to its frontend: a small interface, and its ZMQ implementation."""

from __future__ import annotations

import os
from typing import Protocol

import zmq

from batonlm.ipc import codec
from batonlm.ipc.codec import Message


class SchedulerIO(Protocol):
    def recv(self, timeout_s: float) -> list[Message]:
        """Every message waiting; with `timeout_s > 0`, first block up to that long for one."""
        ...

    def send(self, msg: Message) -> None: ...

    @property
    def closed(self) -> bool:
        """True when no more requests can come (the frontend is gone)."""
        ...


class ZmqSchedulerIO:
    """PULL requests from the frontend, PUSH outputs to it, over `ipc://` endpoints."""

    def __init__(self, request_endpoint: str, output_endpoint: str) -> None:
        self._ctx = zmq.Context(1)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.connect(request_endpoint)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(output_endpoint)
        self._parent = os.getppid()
        self._closed = False

    @property
    def closed(self) -> bool:
        # Orphaned (the main process died without shutting us down): stop serving.
        if not self._closed and os.getppid() != self._parent:
            self._closed = True
        return self._closed

    def recv(self, timeout_s: float) -> list[Message]:
        out: list[Message] = []
        if timeout_s > 0 and not self._pull.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(codec.decode(data))

    def send(self, msg: Message) -> None:
        self._push.send(codec.encode(msg))

    def close(self) -> None:
        self._closed = True
        self._pull.close(0)
        self._push.close()
        self._ctx.term()
