"""What the scheduler does with each message it receives: a new request (checked, seeded, queued
or handed to the grammar queue), an abort, a stats or cache-flush request, a shutdown."""

from __future__ import annotations

import logging
import random
import time
from collections import deque

from batonlm.device.base import DeviceStream, PendingResult
from batonlm.ipc.codec import Message
from batonlm.ipc.device_messages import LoRALoad
from batonlm.ipc.messages import (
    AbortRequest,
    FlushCacheRequest,
    FlushCacheResult,
    GenerateRequest,
    LoadLoRARequest,
    LoadLoRAResult,
    SchedulerStats,
    ShutdownRequest,
    StatsRequest,
    TokenOutput,
)
from batonlm.request_checks import check_request
from batonlm.scheduler.agreement import Agreement
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.grammar_queue import GrammarQueue
from batonlm.scheduler.io import SchedulerIO
from batonlm.scheduler.kv_memory import KVMemory
from batonlm.scheduler.request import FINISH_ABORT, Request

logger = logging.getLogger("batonlm.scheduler.scheduler")

# How long an idle loop blocks on its input while grammars compile (a request should start as
# soon as its grammar is ready).
GRAMMAR_POLL_S = 0.002


class RequestIntake:
    """The Scheduler's input side (a mixin: the state is the Scheduler's)."""

    io: SchedulerIO
    device: DeviceStream
    agreement: Agreement
    memory: KVMemory
    grammars: GrammarQueue
    waiting: deque[Request]
    running: list[Request]
    requests: dict[str, Request]
    lora_keys: dict[int, int]
    result_queue: deque[tuple[ScheduleBatch, PendingResult]]
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dp_rank: int
    _outputs: list[TokenOutput]
    _rng: random.Random
    _shutdown: bool

    def stats(self) -> SchedulerStats:
        raise NotImplementedError

    def _finish(self, req: Request) -> None:
        raise NotImplementedError

    def recv_requests(self) -> float:
        """Handle every message waiting; returns the seconds spent blocked waiting for one."""
        # Block (briefly) only when idle: never spin; look often while grammars compile.
        if self.waiting or self.running or self.result_queue or self.agreement.peers_busy:
            timeout = 0.0
        else:  # idle: no result wait would notice a device that is gone
            timeout = GRAMMAR_POLL_S if self.grammars.pending else self.agreement.idle_poll_s
            self.device.check_health()
        t0 = time.perf_counter()
        messages = self.io.recv(timeout)
        blocked = time.perf_counter() - t0 if timeout else 0.0
        for msg in messages:
            self._handle(msg)
        return blocked

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, GenerateRequest):
            self._add_request(msg)
        elif isinstance(msg, AbortRequest):
            self.abort(msg.rid)
        elif isinstance(msg, StatsRequest):
            self.io.send(self.stats())
        elif isinstance(msg, FlushCacheRequest):
            self.io.send(self.flush_cache())
        elif isinstance(msg, LoadLoRARequest):
            self.io.send(self.load_lora(msg))
        elif isinstance(msg, ShutdownRequest):
            self._shutdown = True
        else:
            logger.error("scheduler got an unexpected message %s", type(msg).__name__)

    def _reject(self, rid: str, error: str, about: str | None = None) -> None:
        logger.info("request %s rejected: %s", rid, error)
        self._outputs.append(TokenOutput(rid, [], FINISH_ABORT, error, error_about=about))

    def load_lora(self, msg: LoadLoRARequest) -> LoadLoRAResult:
        """An adapter into a slot (the frontend checked it, and that no request uses the slot):
        on the device after the launches so far; requests of its earlier load are refused from now."""
        if not 1 <= msg.slot <= self.device.spec.lora_slots:
            return LoadLoRAResult(False, f"no LoRA slot {msg.slot}", self.dp_rank)
        self.device.load_lora(LoRALoad(msg.slot, msg.name, msg.path))
        self.lora_keys[msg.slot] = msg.key
        return LoadLoRAResult(True, "", self.dp_rank)

    def flush_cache(self) -> FlushCacheResult:
        """Empty the prefix cache; refused while requests run or wait."""
        if self.requests or self.result_queue:
            return FlushCacheResult(False, f"{len(self.requests)} request(s) are running or waiting",
                                    self.dp_rank)
        self.memory.flush()
        return FlushCacheResult(True, "", self.dp_rank)

    def _add_request(self, msg: GenerateRequest) -> None:
        params = msg.sampling_params
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        if msg.rid in self.requests:
            return self._reject(msg.rid, f"request id {msg.rid!r} is already in use")
        lora_key = msg.lora_key or msg.lora  # 0: the slot's --lora-paths load
        if msg.lora and self.lora_keys.get(msg.lora) != lora_key:
            return self._reject(msg.rid, "its LoRA adapter was unloaded")
        try:
            check_request(
                msg.input_ids, params, context_length=self.context_length, vocab_size=self.vocab_size,
                kv_capacity=self.memory.capacity,
            )
        except ValueError as e:
            return self._reject(msg.rid, str(e))
        req = Request(msg.rid, list(msg.input_ids), params, seed, self.context_length, self.eos_token_ids,
                      msg.priority, msg.pooling, msg.lora, lora_key)
        self.requests[req.rid] = req
        if params.constraint is not None:
            self.grammars.add(req)  # joins `waiting` when its grammar is compiled
        else:
            self.waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self.grammars.remove(req)
        req.finish_reason = FINISH_ABORT
        self._finish(req)
        self._outputs.append(TokenOutput(rid, [], FINISH_ABORT))
