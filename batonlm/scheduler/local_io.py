"""An in-process SchedulerIO: requests released at chosen iterations, outputs collected.

Drives the scheduler without sockets, for tests of iteration-level behaviour and for the
overlap benchmark.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from batonlm.ipc import codec
from batonlm.ipc.codec import Message
from batonlm.ipc.messages import BatchOutput, SchedulerStats


@dataclass
class RequestRecord:
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    embedding: list[float] | None = None


class LocalIO:
    def __init__(self, iteration: Callable[[], int] = lambda: 0, encode: bool = False) -> None:
        self._iteration = iteration
        # Encode every output as the socket path would (the benchmark counts that CPU work).
        self._encode = encode
        self._pending: list[tuple[int, int, Message]] = []  # (iteration, order, message)
        self._order = 0
        self.records: dict[str, RequestRecord] = defaultdict(RequestRecord)
        self.stats: list[SchedulerStats] = []
        # Called after each BatchOutput is recorded (tests use it to abort mid-decode).
        self.on_output: Callable[[BatchOutput], None] | None = None

    def bind(self, iteration: Callable[[], int]) -> None:
        self._iteration = iteration

    def submit(self, msg: Message, at_iteration: int = 0) -> None:
        self._pending.append((at_iteration, self._order, msg))
        self._order += 1
        self._pending.sort(key=lambda p: (p[0], p[1]))

    @property
    def closed(self) -> bool:
        return not self._pending

    @property
    def orphaned(self) -> bool:
        return False

    def recv(self, timeout_s: float) -> list[Message]:
        now = self._iteration()
        due = [p for p in self._pending if p[0] <= now]
        self._pending = [p for p in self._pending if p[0] > now]
        return [m for _, _, m in due]

    def writable(self, timeout_s: float) -> bool:
        return True  # outputs are collected in a list: never full

    def send(self, msg: Message) -> None:
        if self._encode:
            codec.encode(msg)
        if isinstance(msg, SchedulerStats):
            self.stats.append(msg)
            return
        if not isinstance(msg, BatchOutput) or not msg.outputs:  # heartbeats: no watchdog here
            return
        t = time.perf_counter()
        for out in msg.outputs:
            rec = self.records[out.rid]
            rec.token_ids.extend(out.token_ids)
            rec.token_times.extend([t] * len(out.token_ids))
            rec.logprobs.extend(out.logprobs or [])
            if out.prompt_logprobs is not None:
                rec.prompt_logprobs, rec.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs
            if out.embedding is not None:
                rec.embedding = out.embedding
            if out.finish_reason is not None:
                rec.finish_reason = out.finish_reason
                rec.error = out.error
        if self.on_output is not None:
            self.on_output(msg)
