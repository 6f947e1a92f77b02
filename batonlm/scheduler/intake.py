"""What the scheduler does with each message it receives: a new request (checked, seeded, queued
or handed to the grammar queue), an abort, a stats or cache-flush request, a LoRA adapter's load
or unload, a shutdown."""

from __future__ import annotations

import logging
import random
import time
from collections import deque

from batonlm.device.base import DeviceStream, PendingResult
from batonlm.ipc.codec import Message
from batonlm.ipc.messages import (
    AbortRequest,
    FlushCacheRequest,
    FlushCacheResult,
    GenerateRequest,
    LoadLoRARequest,
    LoRAResult,
    SchedulerStats,
    ShutdownRequest,
    StatsRequest,
    TokenOutput,
    UnloadLoRARequest,
)
from batonlm.request_checks import check_request
from batonlm.scheduler.agreement import Agreement
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.grammar_queue import GrammarQueue
from batonlm.scheduler.io import SchedulerIO
from batonlm.scheduler.kv_memory import KVMemory
from batonlm.scheduler.lora_slots import LoRASlots
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
    lora: LoRASlots | None
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
        elif isinstance(msg, LoadLoRARequest | UnloadLoRARequest):
            self.io.send(self.update_lora(msg))
        elif isinstance(msg, ShutdownRequest):
            self._shutdown = True
        else:
            logger.error("scheduler got an unexpected message %s", type(msg).__name__)

    def _reject(self, rid: str, error: str, about: str | None = None) -> None:
        logger.info("request %s rejected: %s", rid, error)
        self._outputs.append(TokenOutput(rid, [], FINISH_ABORT, error, error_about=about))

    def update_lora(self, msg: LoadLoRARequest | UnloadLoRARequest) -> LoRAResult:
        """A run-time load (checked by the frontend) or unload (no request of it runs: the
        frontend checked); requests of an unloaded adapter are refused from now."""
        if self.lora is None:
            return LoRAResult(False, "LoRA is off", self.dp_rank)
        if isinstance(msg, LoadLoRARequest):
            self.lora.load(msg.key, msg.name, msg.path)
        else:
            self.lora.unload(msg.key)
        return LoRAResult(True, "", self.dp_rank)

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
        if msg.lora_key and (self.lora is None or msg.lora_key not in self.lora.loaded):
            return self._reject(msg.rid, "its LoRA adapter was unloaded")
        try:
            check_request(
                msg.input_ids, params, context_length=self.context_length, vocab_size=self.vocab_size,
                kv_capacity=self.memory.capacity,
            )
        except ValueError as e:
            return self._reject(msg.rid, str(e))
        req = Request(msg.rid, list(msg.input_ids), params, seed, self.context_length, self.eos_token_ids,
                      msg.priority, msg.pooling, msg.lora_key)
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
