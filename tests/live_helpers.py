"""Helpers for tests against a live server: metrics, polling, raw sockets."""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import httpx

BATONLM = str(Path(sys.executable).parent / "batonlm")  # the console script `pip install` made


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


SCALE_OUT_PROMPTS = ["Once upon a time", "The dog ran to the park and", "Lily wanted a red ball", "Tom had a big box"]


def greedy_completions(base_url: str) -> list[str]:
    """The greedy 30-token completions of SCALE_OUT_PROMPTS through the openai client (the first
    also streamed, and checked equal): what the scale-out tests compare servers by."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="none")
    texts = [client.completions.create(model="stories260K", prompt=p, max_tokens=30, temperature=0).choices[0].text
             for p in SCALE_OUT_PROMPTS]
    streamed = "".join(e.choices[0].text for e in client.completions.create(
        model="stories260K", prompt=SCALE_OUT_PROMPTS[0], max_tokens=30, temperature=0, stream=True))
    assert streamed == texts[0]
    return texts
