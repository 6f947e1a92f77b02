"""The server's HTTP protocol sends small writes at once (TCP_NODELAY), on every accepted socket."""

import socket

from batonlm.server.http_protocol import _no_delay


class _Transport:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None


def test_accepted_sockets_get_tcp_nodelay():
    # A listening socket made without proto=IPPROTO_TCP, as asyncio then leaves Nagle on.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        _no_delay(_Transport(accepted))
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        for s in (client, accepted, listener):
            s.close()
