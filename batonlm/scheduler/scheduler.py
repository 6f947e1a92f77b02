"""The scheduler: continuous batching with a normal and an overlap event loop (its input side,
what each received message does, is in intake.py).

One iteration: receive requests -> build the next batch -> run it -> process results. The
normal loop processes batch N's results before building batch N+1. The overlap loop launches
batch N first and processes batch N-1 while the device computes N; decode inputs reach the
device through the FutureMap, so building N never waits for N-1's tokens.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass

from batonlm.device.base import DeviceStream, PendingResult
from batonlm.ipc.device_messages import SampleLaunch
from batonlm.ipc.messages import (
    ABOUT_CONSTRAINT,
    BatchOutput,
    SchedulerStats,
    TokenOutput,
    merge_outputs,
)
from batonlm.scheduler.agreement import Agreement
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.grammar_queue import GrammarQueue, grammar_backend
from batonlm.scheduler.intake import RequestIntake
from batonlm.scheduler.io import SchedulerIO
from batonlm.scheduler.kv_memory import KVMemory
from batonlm.scheduler.lora_slots import LoRASlots
from batonlm.scheduler.outputs import emit, take_pooled, take_prompt_logprobs, token_output, verified_rows
from batonlm.scheduler.overlap_policy import (
    DISABLE_CONSECUTIVE_PREFILL_ENV,
    env_flag,
    is_disable_overlap_for_batch,
    must_process_before_planning,
)
from batonlm.scheduler.planner import BatchPlanner, PlannerConfig
from batonlm.scheduler.request import Request
from batonlm.scheduler.speculative import SpecConfig, Speculator
from batonlm.scheduler.status_log import StatusLog
from batonlm.scheduler.timing import LoopTiming
from batonlm.settings import derive

logger = logging.getLogger(__name__)

BACKPRESSURE_WAIT_S = 0.05  # how long one iteration waits for a frontend that does not read
HEARTBEAT_S = 1.0  # a busy scheduler sends at least this often (batonlm/tokenizer_manager/watchdog.py)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler runs by: fields named like a server argument are that argument
    (`build_scheduler` derives them), the rest come from the model and the device."""

    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None = None  # None: prompts are prefilled whole
    enable_mixed_batch: bool = False
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    priority_aging_s: float = 60.0
    enable_priority_preemption: bool = False
    random_seed: int = 0
    stream_interval: int = 1  # a request's tokens go out every this many (its first and last at once)
    tokenizer_path: str | None = None  # for grammars: the vocabulary's token strings
    grammar_whitespace: str = "bounded"
    grammar_compile_timeout: float = 60.0
    dp_rank: int = 0  # the data-parallel replica this scheduler is
    speculative: SpecConfig | None = None  # speculative decoding, when on
    long_rope_from: int | None = None  # LongRoPE's original context (planner.PlannerConfig)


class Scheduler(RequestIntake):
    """Requests in, batches out, both event loops; what each input message does is in intake.py."""

    def __init__(self, io: SchedulerIO, device: DeviceStream, config: SchedulerConfig) -> None:
        self.io = io
        self.device = device
        self.config = config
        self.context_length = config.context_length
        self.vocab_size, self.eos_token_ids, self.dp_rank = config.vocab_size, config.eos_token_ids, config.dp_rank
        self.disable_consecutive_prefill_overlap = env_flag(DISABLE_CONSECUTIVE_PREFILL_ENV)
        # What this scheduler agrees on with other data-parallel replicas (DP attention sets its own).
        self.agreement = Agreement()

        spec = device.spec
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None
        self.memory = KVMemory(spec.kv_capacity, spec.num_req_slots, radix_cache=not config.disable_radix_cache)
        mixed = config.enable_mixed_batch or config.chunked_prefill_size is not None
        # LoRA: which adapter each device slot holds (None: LoRA is off).
        self.lora = (LoRASlots(spec.lora_slots, range(1, len(spec.lora_adapters) + 1), device.update_lora)
                     if spec.lora_slots else None)
        self.planner = BatchPlanner(derive(PlannerConfig, config, mixed=mixed), self.memory, self.speculator,
                                    self.lora)
        # Ordered containers only: batch order must be the same in every run.
        self.waiting: deque[Request] = deque()
        self.grammars = GrammarQueue(  # constrained requests while their grammar compiles
            lambda: grammar_backend(config.tokenizer_path, config.vocab_size, config.eos_token_ids,
                                    config.grammar_whitespace),
            compile_timeout_s=config.grammar_compile_timeout,
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.result_queue: deque[tuple[ScheduleBatch, PendingResult]] = deque()
        # What the last iteration ran (an empty batch when a DP-attention replica idled).
        self.last_batch: ScheduleBatch | None = None
        self._outputs: list[TokenOutput] = []
        self._next_batch_id = 0
        self._shutdown = False
        # Unseeded requests draw their seed from this per-engine generator, in arrival order.
        self._rng = random.Random(config.random_seed)

        self.iteration = 0
        self.timing = LoopTiming()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        # Tokens sampled for requests already finished or retracted (the one-step overrun).
        self.dropped_tokens = 0
        self.status_log = StatusLog()
        self._iteration_end = time.perf_counter()
        self._processed_early = False  # this iteration processed the last result before planning
        self._held_since: float | None = None  # when the frontend stopped reading (back-pressure)
        self._last_sent = time.monotonic()

    # ------------------------------------------------------------------ state
    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running and not self.result_queue and not self.grammars.pending

    def stats(self) -> SchedulerStats:
        """The counters `/metrics` and `Engine.stats()` read."""
        return SchedulerStats(
            num_running=sum(1 for r in self.running if not r.finished),
            num_waiting=len(self.waiting),
            num_compiling=len(self.grammars.pending),
            retractions=self.planner.num_retractions,
            preemptions={str(p): n for p, n in sorted(self.planner.preempted.items())},
            iterations=self.iteration,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            scheduler_cpu_s=self.timing.cpu_s,
            device_wait_s=self.timing.wait_s,
            device_compute_s=self.device.compute_s,
            batches=self.timing.batches,
            lora_placements=self.lora.placements if self.lora is not None else 0,
            dp_rank=self.config.dp_rank,
            **self.memory.stats_fields(),
            **self.agreement.stats_fields(),
            **(self.speculator.stats.as_fields() if self.speculator is not None else {}),
        )

    def _should_exit(self) -> bool:
        # Orphaned: nobody reads our outputs any more; stop now (running requests are aborted).
        return self._shutdown or self.io.orphaned or (self.io.closed and self.is_idle)

    # ------------------------------------------------------------------ batches
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """What the planner makes of the waiting and running requests (planner.py)."""
        self.running = [r for r in self.running if not r.finished]
        if self.grammars.pending:
            ready, failed = self.grammars.poll()
            self.waiting.extend(ready)
            for req, error in failed:
                self.requests.pop(req.rid, None)
                self._reject(req.rid, error, about=ABOUT_CONSTRAINT)
        batch = self.planner.plan(self._next_batch_id, self.waiting, self.running)
        if not batch:
            return None
        self._next_batch_id += 1
        for r in batch.reqs:
            r.inflight += 1
            batch.epochs.append(r.epoch)
        self.prompt_tokens += sum(row.extend_len for row in batch.extend)
        batch.delay_sampling = self.needs_delayed_sampling(batch)
        # Fixed now: processing the previous result before the launch (the overlap policy) may
        # finish a request of this batch and release its slots.
        batch.launch = batch.to_launch()
        return batch

    def needs_delayed_sampling(self, batch: ScheduleBatch) -> bool:
        """A batch whose sampling needs state its predecessor's result updates: grammar masks
        (`GrammarQueue.masks`), or what `sampling_masks` forbids."""
        return self.grammars.needs_masks(batch)

    def sampling_masks(self, batch: ScheduleBatch) -> dict[int, list[int]]:
        """Hook: row -> token ids to forbid, computed after the previous result was processed."""
        return {}

    def run_batch(self, batch: ScheduleBatch) -> PendingResult:
        t0 = time.perf_counter()
        assert batch.launch is not None
        pending = self.device.launch(batch.launch)
        self.timing.launch_s += time.perf_counter() - t0
        return pending

    def launch_delayed_sampling(self, batch: ScheduleBatch | None) -> None:
        if batch and batch.delay_sampling:
            self.device.launch_sampling(
                SampleLaunch(batch.batch_id, {batch.launch_rows[r]: ids for r, ids in self.sampling_masks(batch).items()},
                             **self.grammars.masks(batch))
            )

    # ------------------------------------------------------------------ results
    def pop_and_process(self) -> None:
        if self.result_queue:
            batch, pending = self.result_queue.popleft()
            self.process_batch_result(batch, pending)

    def process_batch_result(self, batch: ScheduleBatch, pending: PendingResult) -> None:
        t0 = time.perf_counter()
        result = pending.wait()
        t1 = time.perf_counter()
        ids, lp = result.token_ids, result.logprobs  # per launch row (batch.launch_rows)
        take_prompt_logprobs(batch, result.prompt_logprobs)
        take_pooled(batch, result.pooled)
        verified = verified_rows(batch, result.accepted)
        rows = zip(batch.reqs, batch.epochs, batch.produces_output, batch.launch_rows, strict=True)
        for row, (req, epoch, produces, at) in enumerate(rows):
            req.inflight -= 1
            if req.finished or epoch != req.epoch:
                # The one-step overrun, an abort, or a retraction since the launch: drop the
                # token; free the request slot once no forward of it is in flight any more.
                self.dropped_tokens += 1
                self._release_req_slot_if_idle(req)
                continue
            if not produces:  # a chunk that does not finish the prompt
                continue
            tokens = [ids[at]]
            if row in verified:  # accepted drafts, then the token after them; drop the rest's KV
                accepted = verified[row]
                tokens = ids[at : at + accepted + 1]
                drafted = len(batch.drafts[row - len(batch.extend)])
                self.memory.trim(req, req.kv_len - drafted + accepted)
                assert self.speculator is not None  # only its drafts are verified
                self.speculator.verified(req, drafted, accepted)
            tokens = emit(req, tokens)
            req.num_outputs_launched = max(req.num_outputs_launched, len(req.output_ids))
            self.generated_tokens += len(tokens)
            if req.finished:
                self._finish(req)
            self._emit(req, token_output(req, tokens, lp, at))
        self.timing.wait_s += t1 - t0
        self.timing.process_s += time.perf_counter() - t1

    def _emit(self, req: Request, out: TokenOutput) -> None:
        """Send `out` with this iteration's outputs, or hold it until `req` has
        `stream_interval` tokens waiting; its first output and its last go at once."""
        if self.config.stream_interval == 1:
            self._outputs.append(out)
            return
        req.held.append(out)
        first = len(req.output_ids) == len(out.token_ids)
        if first or req.finished or sum(len(o.token_ids) for o in req.held) >= self.config.stream_interval:
            self._outputs.append(merge_outputs(req.held) if len(req.held) > 1 else out)
            req.held = []

    def _release_req_slot_if_idle(self, req: Request) -> None:
        if req.inflight == 0 and not req.admitted:
            self.memory.release_req_slot(req)

    def _finish(self, req: Request) -> None:
        """Release what a finished request holds. Its KV goes to the cache (or is freed) at once
        (device work is ordered); its request slot waits for its in-flight forwards."""
        if req.admitted:
            self.memory.release(req)
        self._release_req_slot_if_idle(req)
        self.requests.pop(req.rid, None)

    def flush_outputs(self) -> None:
        now = time.monotonic()
        # Busy without outputs (prefill chunks, compiles): a heartbeat now and then tells the
        # frontend's watchdog this scheduler still finishes iterations.
        if self._outputs or (now - self._last_sent > HEARTBEAT_S and not self.is_idle):
            self.io.send(BatchOutput(self._outputs, self.dp_rank))
            self._outputs = []
            self._last_sent = now

    # ------------------------------------------------------------------ loops
    def event_loop_normal(self) -> None:
        """Serial: run batch N and process its results before building batch N+1."""
        while self.agreement.keep_running(self._should_exit()):
            batch = self.next_batch()
            self.agreement.decided(disable_overlap=True)
            if batch:
                pending = self.run_batch(batch)
                self.launch_delayed_sampling(batch)
                self.process_batch_result(batch, pending)
            self.end_iteration(batch)
        self._drain()

    def event_loop_overlap(self) -> None:
        """Launch batch N, then process batch N-1 while the device computes N."""
        while self.agreement.keep_running(self._should_exit()):
            self.process_before_planning()
            batch = self.next_batch()
            overlap = self.decide_overlap(batch)
            if not overlap:
                self.pop_and_process()
            if batch:
                self.result_queue.append((batch, self.run_batch(batch)))
            if overlap:
                self.process_previous(batch)  # batch N-1's result, while the device computes N
            self.launch_delayed_sampling(batch)
            self.end_iteration(batch)
        self._drain()

    def next_batch(self) -> ScheduleBatch | None:
        """Receive requests, plan the next batch, agree on it with the other replicas (DP
        attention). A falsy batch: nothing to run."""
        t0 = time.perf_counter()
        idle = self.recv_requests()
        # Back-pressure: while the frontend does not read, plan nothing (the outputs would only
        # pile up); requests keep arriving and aborts keep working (io.py).
        t_wait = time.perf_counter()
        writable = self.io.writable(BACKPRESSURE_WAIT_S)
        idle += time.perf_counter() - t_wait
        self._note_backpressure(writable, t_wait)
        batch = self.get_next_batch_to_run() if writable else None
        self.timing.schedule_s += time.perf_counter() - t0 - idle
        self.timing.idle_s += idle
        done = self.io.closed and self.is_idle
        return self.agreement.agree(batch, done=done, stop=self._shutdown or self.io.orphaned)

    def _note_backpressure(self, writable: bool, now: float) -> None:
        if not writable and self._held_since is None:
            self._held_since = now
            logger.warning("the frontend is not reading its outputs: decoding paused until it does "
                           "(%d requests running)", len(self.requests))
        elif writable and self._held_since is not None:
            logger.warning("the frontend reads again: decoding resumed after %.1f s", now - self._held_since)
            self._held_since = None

    def process_before_planning(self) -> None:
        """Speculative decoding: how many drafts the last batch's verifications accepted decides
        the positions of the next rows, so its result is processed before planning."""
        self._processed_early = must_process_before_planning(self.last_batch)
        if self._processed_early:
            self.pop_and_process()

    def decide_overlap(self, batch: ScheduleBatch | None) -> bool:
        """Whether the previous result is processed while `batch` runs (overlap_policy.py)."""
        disable = is_disable_overlap_for_batch(
            batch,
            self.last_batch,
            disable_consecutive_prefill=self.disable_consecutive_prefill_overlap,
            result_queued=bool(self.result_queue),
            require_mlp_sync=self.agreement.require_mlp_sync,
        )
        self.agreement.decided(disable)
        return not disable

    def process_previous(self, batch: ScheduleBatch | None) -> None:
        """Process the result queued before `batch` (none when it was processed early)."""
        if len(self.result_queue) > (1 if batch else 0):
            self.pop_and_process()

    def end_iteration(self, batch: ScheduleBatch | None) -> None:
        t0 = time.perf_counter()
        self.flush_outputs()
        self.timing.process_s += time.perf_counter() - t0
        # A decode iteration's time: one that waited on a verification's result (it was processed
        # before planning), or an overlapped one (the drafting policy's cost ratio).
        if self.speculator is not None and batch and batch.decode and not batch.extend:
            self.speculator.observe(self._processed_early, t0 - self._iteration_end)
        self._iteration_end = t0
        self.last_batch = batch
        self.iteration += 1
        if batch:
            self.timing.batches += 1
        if self.status_log.due() and not self.is_idle:
            self.status_log.log(self.stats())

    def _drain(self) -> None:
        """On exit: finish processing what is in flight, abort what is left, report it."""
        while self.result_queue:
            self.pop_and_process()
        for rid in list(self.requests):
            self.abort(rid)
        self.flush_outputs()
        self.last_batch = None
