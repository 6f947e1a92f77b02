"""Helpers for tests against a live server: metrics, polling, raw sockets."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx


def metric(base_url: str, name: str, labels: str = "") -> float:
    """A metric's value; `labels` is a regex the label set must contain (e.g. 'finish_reason="abort"')."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    m = re.search(rf'^{name}(?:{{[^}}]*{labels}[^}}]*}})? ([0-9.e+-]+)$', text, re.M)
    if m is None and labels:
        return 0.0  # a labelled counter appears at its first increment
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def wait_until(cond, timeout: float = 20.0, what: str = "condition") -> float:
    """Poll `cond` until it holds (a bound, not a measurement: the time taken is not asserted)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what} not reached within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def connect(base_url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = base_url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    return s


def request_bytes(path: str, body: bytes, *, content_length: int | None = None) -> bytes:
    n = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
            .encode() + body)


def closed_by_server(sock: socket.socket, timeout: float) -> bytes:
    """Read until the server closes the connection; what it sent. Fails after `timeout`."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
