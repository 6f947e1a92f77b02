"""uvicorn's h11 protocol, guarded against clients that hold connections without using them.

uvicorn closes a connection that stays idle between requests (`timeout_keep_alive`), but not
one that sends a request line and then headers a byte at a time, one that connects and says
nothing, or one that stops reading a streamed response: each would hold a file descriptor (and,
for a stream, its buffered output) forever. Here
* a connection waiting for a request's head gets `client_timeout` seconds to deliver all of it
  (the body has its own deadline in the app, `read_json`);
* a response whose client stops reading (the socket buffer stays full) for `client_timeout`
  seconds is cut off, which ends its request;
* beyond `max_connections` open connections a new one is answered 503 and closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def _busy_response() -> bytes:
    body = json.dumps({"error": {
        "message": "the server has too many open connections; retry later", "type": "service_unavailable",
        "param": None, "code": "too_many_connections",
    }}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_BUSY = _busy_response()


def _no_delay(transport: asyncio.Transport) -> None:
    """Send small writes (an SSE event, a short answer) at once. asyncio does this only for
    sockets created with proto=IPPROTO_TCP; without it, Nagle's algorithm and the client's
    delayed ACK held each answer on a keep-alive connection for 40 ms."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class GuardedH11Protocol(H11Protocol):
    client_timeout: float = 30.0
    max_connections: int = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False

    # A stream protocol is given an asyncio.Transport; asyncio's signature says BaseTransport.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        if len(self.connections) > self.max_connections:
            logger.warning("refusing a connection: %d are open (--max-connections)", len(self.connections) - 1)
            self._refused = True
            transport.write(_BUSY)
            transport.close()
            return
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_head_timer")
        self._cancel("_write_timer")
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.client_timeout, self._not_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_write_timer")

    # ------------------------------------------------------------------ timers
    def _awaiting_head(self) -> bool:
        # No request yet, or the last one answered: the next bytes are a new request's head.
        return self.cycle is None or self.cycle.response_complete

    def _watch_head(self) -> None:
        """After a connection opens or bytes arrive: a request whose head is still incomplete
        (a new connection, or the start of a next request, which stops uvicorn's keep-alive
        timer) must complete it in time; a request in progress needs no timer."""
        if self.transport.is_closing() or not self._awaiting_head():
            self._cancel("_head_timer")
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.client_timeout, self._head_too_slow)

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            logger.info("closing a connection that sent no complete request head in %g s", self.client_timeout)
            self.transport.close()

    def _not_reading(self) -> None:
        self._write_timer = None
        if self.flow.write_paused and not self.transport.is_closing():
            logger.info("closing a connection whose client read nothing for %g s", self.client_timeout)
            self.transport.abort()


def guarded_protocol(client_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type(
        "GuardedH11Protocol", (GuardedH11Protocol,),
        {"client_timeout": client_timeout, "max_connections": max_connections},
    )
