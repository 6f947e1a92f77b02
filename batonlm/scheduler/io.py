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
        """True when no more requests can come."""
        ...

    @property
    def orphaned(self) -> bool:
        """True when the frontend is gone: nobody will read what is still running."""
        ...


class ZmqSchedulerIO:
    """PULL requests from the frontend, PUSH outputs to it, over `ipc://` endpoints."""

    def __init__(self, request_endpoint: str, output_endpoint: str) -> None:
        self._ctx = zmq.Context(1)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.connect(request_endpoint)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        # A dead frontend never reads: give up on a send instead of blocking forever.
        self._push.setsockopt(zmq.SNDTIMEO, 1000)
        self._push.connect(output_endpoint)
        self._parent = os.getppid()
        self._closed = False

    @property
    def orphaned(self) -> bool:
        # The main process died without shutting us down.
        return os.getppid() != self._parent

    @property
    def closed(self) -> bool:
        return self._closed or self.orphaned

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
        try:
            self._push.send(codec.encode(msg))
        except zmq.Again:
            if not self.orphaned:
                raise

    def close(self) -> None:
        self._closed = True
        self._pull.close(0)
        self._push.close()
        self._ctx.term()
