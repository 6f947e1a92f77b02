"""A fake OpenAI-compatible streaming server with fixed, known timings, for testing the bench.

Plain asyncio HTTP/1.1 (keep-alive, chunked SSE) on a free port in a background thread. Each
streamed POST sends its first content chunk `ttft` s after the request arrived and the others
every `itl` s after that (on absolute deadlines, so delays do not drift); it sends as many
tokens as `max_tokens`/`max_completion_tokens` asks, `tokens_per_chunk` to a chunk. `failures`
maps the 1-based number of a POST to a way to fail it: "500", "drop" (connection cut after two
chunks), "error" (an error event mid-stream), "stall" (headers, then nothing), "no_done".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MODEL = "fake-model"


@dataclass
class Received:
    number: int
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    t: float


@dataclass
class FakeServer:
    ttft: float = 0.1
    itl: float = 0.03
    tokens_per_chunk: int = 1
    send_usage: bool = True
    failures: dict[int, str] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    peak_active: int = 0
    port: int = 0

    def __post_init__(self) -> None:
        self._active = 0
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="fake-openai")
        self._server: asyncio.base_events.Server | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FakeServer:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop)
        self._server = fut.result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def posts(self) -> list[Received]:
        return [r for r in self.received if r.path not in ("/v1/models", "/metrics")]

    # ------------------------------------------------------------------ HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is done."""
        line = await reader.readline()
        if not line:
            return False
        t = time.perf_counter()
        method, path, _ = line.decode().split(" ", 2)
        headers: dict[str, str] = {}
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, v = h.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        raw = await reader.readexactly(int(headers.get("content-length", 0)))
        body = json.loads(raw) if raw else {}
        number = len(self.posts()) + 1 if method == "POST" else 0
        self.received.append(Received(number, path, headers, body, t))
        if method == "GET" and path == "/v1/models":
            await self._send_json(writer, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            return True
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await self._send_json(writer, 404, {"error": {"message": f"no route {method} {path}"}})
            return True
        how = self.failures.get(number)
        if how == "500":
            await self._send_json(writer, 500, {"error": {"message": "boom"}})
            return True
        self._active += 1
        self.peak_active = max(self.peak_active, self._active)
        try:
            return await self._stream(reader, writer, path.endswith("chat/completions"), body, t, how)
        finally:
            self._active -= 1

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        await writer.drain()

    async def _event(self, writer: asyncio.StreamWriter, payload: str) -> None:
        data = f"data: {payload}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chat: bool, body: dict, t: float, how: str | None) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        if how == "stall":  # until the client gives up and closes the connection
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(), 30)
            return False
        n_tokens = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        n_chunks = -(-n_tokens // self.tokens_per_chunk)
        if chat:  # as vLLM does: a role-only first chunk, with no content, straight away
            await self._event(writer, json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        for i in range(n_chunks):
            await asyncio.sleep(max(0.0, t + self.ttft + i * self.itl - time.perf_counter()))
            k = min(self.tokens_per_chunk, n_tokens - i * self.tokens_per_chunk)
            text = " tok" * k
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            await self._event(writer, json.dumps({"choices": [choice], "usage": None}))
            if how == "drop" and i == 1:
                writer.transport.abort()
                return False
            if how == "error" and i == 0:
                await self._event(writer, json.dumps({"error": {"message": "engine exploded", "code": 500}}))
                break
        if self.send_usage and how != "error":
            usage = {"prompt_tokens": 7, "completion_tokens": n_tokens, "total_tokens": 7 + n_tokens}
            await self._event(writer, json.dumps({"choices": [], "usage": usage}))
        if how != "no_done":
            await self._event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
