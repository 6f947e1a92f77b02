"""BatchPlanner: what the next batch runs, within the KV memory.

Each iteration (with chunked prefill or mixed batches, all in one batch; otherwise a batch of
extend rows when any can run, else a decode batch):
1. the request in the middle of its prefill (a prompt longer than a chunk, or one resuming after
   a retraction) continues with its next chunk;
2. running requests past their prefill decode one token each, allocating one KV slot each;
3. waiting requests are admitted in policy order (`schedule_policy.py`) while the iteration's
   extend budget lasts and their estimated need fits: what they must compute now plus a share
   of the outputs they may still generate (`NewTokenRatio`), after what the running requests
   may still need. Each gets its cached prefix from the radix cache; at most one prompt is cut
   into chunks at a time.
When the pool cannot give a row its slots, running requests are retracted, fewest generated
tokens first (with the priority policy: the lowest priority first): their KV goes to the cache,
and they wait at the front of the queue to resume from prompt + outputs. With priority
preemption, before all this, running requests of lower priority are retracted for the first
waiting request when it could not be admitted otherwise.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from batonlm.scheduler.batch import ExtendRow, ScheduleBatch
from batonlm.scheduler.kv_memory import KVMemory
from batonlm.scheduler.lora_slots import LoRASlots
from batonlm.scheduler.request import Request
from batonlm.scheduler.schedule_policy import admission_order
from batonlm.scheduler.speculative import Speculator

logger = logging.getLogger(__name__)

# A running request's future need is estimated from at most this many of its remaining tokens.
CLIP_MAX_NEW_TOKENS = 2048


class NewTokenRatio:
    """The share of a request's remaining max_new_tokens it is assumed to still generate (SGLang's
    new_token_ratio): high at first, decaying with every decode step while memory suffices,
    back to its initial value after a retraction."""

    def __init__(self, init: float = 0.7, minimum: float = 0.1, decay_steps: int = 600) -> None:
        self.init, self.minimum = init, minimum
        self.decay = (init - minimum) / decay_steps
        self.value = init

    def step(self) -> None:
        self.value = max(self.minimum, self.value - self.decay)

    def reset(self) -> None:
        self.value = self.init


@dataclass(frozen=True)
class PlannerConfig:
    max_running_requests: int
    max_prefill_tokens: int
    chunked_prefill_size: int | None  # None: prompts are never cut
    mixed: bool  # extend and decode rows in one batch
    schedule_policy: str = "fcfs"
    age_bound: int = 256  # iterations (lpm)
    priority_aging_s: float = 60.0  # priority: a request waiting this long goes first
    enable_priority_preemption: bool = False
    # LongRoPE: the original context. A request longer than it is rotated by the long factors at
    # every position, as transformers does; one that grows past it is recomputed so (None: no
    # LongRoPE).
    long_rope_from: int | None = None


class BatchPlanner:
    def __init__(self, config: PlannerConfig, memory: KVMemory, speculator: Speculator | None = None,
                 lora: LoRASlots | None = None) -> None:
        self.config = config
        self.memory = memory
        self.speculator = speculator  # speculative decoding: drafts for decode rows
        self.lora = lora  # LoRA: which adapter each device slot holds (None: LoRA is off)
        self.ratio = NewTokenRatio()
        self.num_retractions = 0
        self.num_rotation_switches = 0  # LongRoPE: requests recomputed past the original context
        self.preempted: dict[int, int] = {}  # priority -> requests of it retracted for a higher one

    def plan(self, batch_id: int, waiting: deque[Request], running: list[Request]) -> ScheduleBatch:
        """Fill a batch (possibly empty), moving admitted requests from `waiting` to `running`
        and retracted ones back; allocates every KV slot the batch writes."""
        cfg = self.config
        batch = ScheduleBatch(batch_id)
        retracted: list[Request] = []
        switches = self.num_rotation_switches
        budget = min(cfg.chunked_prefill_size or cfg.max_prefill_tokens, cfg.max_prefill_tokens)
        chunking = next((r for r in running if r.prefilling), None)
        if cfg.enable_priority_preemption and cfg.schedule_policy == "priority" and waiting:
            self._preempt(waiting, running, retracted, keep=set() if chunking is None else {id(chunking)})
        if chunking is not None:
            budget -= self._continue(batch, chunking, budget, running, retracted)
        if cfg.mixed:
            self._decode(batch, running, retracted)
            self._admit(batch, waiting, running, budget)
        else:
            if chunking is None:
                self._admit(batch, waiting, running, budget)
            if not batch.extend:
                self._decode(batch, running, retracted)
        pressed = len(retracted) - (self.num_rotation_switches - switches)  # for room, not rotation
        if retracted:
            waiting.extendleft(reversed(retracted))
        if pressed:
            self.ratio.reset()
            self.num_retractions += pressed
            logger.info("retracted %d request(s): the KV pool is full", pressed)
        elif batch.decode:
            self.ratio.step()
        for req in waiting:
            req.waited += 1
        return batch

    # ------------------------------------------------------------------ rows
    def _extend(self, batch: ScheduleBatch, req: Request, n: int) -> None:
        """Add `req`'s next n tokens to the batch (its slots must be available)."""
        prefix = req.kv_len
        self.memory.alloc(req, n)
        req.kv_len += n
        batch.extend.append(ExtendRow(req, prefix, n, first=not req.slot_sent))
        req.slot_sent = True
        if req.kv_len == req.fill_len:  # this chunk's last logits give the next output
            req.num_outputs_launched = len(req.output_ids) + 1

    def _continue(
        self, batch: ScheduleBatch, req: Request, budget: int, running: list[Request], retracted: list[Request]
    ) -> int:
        left = req.fill_len - req.kv_len
        n = left if self.config.chunked_prefill_size is None else min(left, budget)
        self._make_room(lambda: n, running, retracted, keep={id(req)})
        n = min(n, self.memory.available)
        if n > 0:
            self._extend(batch, req, n)
        return n

    def _decode(self, batch: ScheduleBatch, running: list[Request], retracted: list[Request]) -> None:
        extending = {id(row.req) for row in batch.extend}
        decode = [r for r in running if r.can_decode and id(r) not in extending]
        decode = self._switch_rotation(decode, running, retracted)
        self._make_room(lambda: sum(r.can_decode for r in decode), running, retracted, keep=extending)
        decode = [r for r in decode if r.can_decode][: self.memory.available]
        spec = self.speculator if self.speculator is not None and self.speculator.active(len(decode)) else None
        spare = self.memory.available - len(decode)  # slots drafts may take, beyond one per row
        for req in decode:
            req.num_outputs_launched += 1
        all_drafts = spec.plan(decode) if spec is not None else None
        row_drafts: list[list[int]] = []
        cross = self.config.long_rope_from
        for i, req in enumerate(decode):
            drafts = all_drafts[i][: max(0, spare)] if all_drafts is not None else []
            if cross is not None and not req.long_rope:  # no draft past the original context
                drafts = drafts[: max(0, cross - req.kv_len - 1)]
            spare -= len(drafts)
            row_drafts.append(drafts)
        self.memory.free_up(len(decode) + sum(map(len, row_drafts)))
        drafted: list[tuple[Request, list[int]]] = []
        plain: list[Request] = []
        for req, drafts in zip(decode, row_drafts):
            self.memory.alloc(req, 1 + len(drafts))
            req.kv_len += 1 + len(drafts)
            if drafts:
                drafted.append((req, drafts))
            else:
                plain.append(req)
        # Verifying rows first: decode rows stay together (one attention row group).
        batch.decode = [r for r, _ in drafted] + plain
        batch.drafts = [d for _, d in drafted] + [[] for _ in plain] if drafted else []
        batch.is_speculative = bool(drafted)
        # The seed's rule (overlap_policy): a speculative batch with a grammar waits for the
        # previous result before it launches.
        batch.has_grammar = any(r.matcher is not None for r in batch.decode)

    def _switch_rotation(self, decode: list[Request], running: list[Request], retracted: list[Request]) -> list[Request]:
        """LongRoPE: a request whose next position is past the original context is recomputed
        under the long rotation (retracted, then admitted again with its outputs as its prompt:
        transformers re-encodes the whole sequence there too). Once its newest token is known."""
        cross = self.config.long_rope_from
        if cross is None:
            return decode
        keep = []
        for req in decode:
            if req.long_rope or req.kv_len < cross:
                keep.append(req)
            elif req.num_outputs_launched == len(req.output_ids):
                self._retract(req, running)
                retracted.append(req)
                self.num_rotation_switches += 1
        return keep

    def _admit(self, batch: ScheduleBatch, waiting: deque[Request], running: list[Request], budget: int) -> None:
        cfg, mem = self.config, self.memory
        if budget <= 0 or not waiting or any(r.prefilling for r in running):
            return
        reserved = sum(self._future_need(r) for r in running)
        # LoRA: the running requests' adapters keep their slots. Once a request waits for a slot,
        # the adapter requests after it wait too (admitted, they would keep the slots' adapters
        # running and it could wait forever); the base model's requests still go ahead.
        busy = {r.lora_key for r in running if r.lora_key} if self.lora is not None else set()
        held_back = False
        for req in admission_order(waiting, cfg.schedule_policy, mem.cache, cfg.age_bound, cfg.priority_aging_s):
            if len(running) >= cfg.max_running_requests or mem.req_slots.num_free == 0 or budget <= 0:
                break
            if req.req_slot is not None:  # retracted with a launch still in flight: next time
                break
            if self.lora is not None and req.lora_key:
                if held_back:
                    continue
                if not self.lora.can_place(req.lora_key, busy):
                    held_back = True  # every slot's adapter is running: it waits, the base model's go first
                    continue
            req.long_rope = cfg.long_rope_from is not None and len(req.fill_ids) > cfg.long_rope_from
            mem.match(req)
            need_now = req.fill_len - req.kv_len
            need = need_now + self._output_estimate(req)
            alone = not running
            fits = need_now <= mem.available if alone else need <= mem.available - reserved
            whole = cfg.chunked_prefill_size is None
            if not fits or (whole and need_now > budget and batch.extend):
                mem.release(req)
                mem.release_req_slot(req)
                break
            waiting.remove(req)
            if self.lora is not None and req.lora_key:
                req.lora = self.lora.slot_for(req.lora_key, busy)
                busy.add(req.lora_key)
            running.append(req)
            req.waited = 0
            req.slot_sent = False
            req.num_outputs_launched = len(req.output_ids)
            reserved += need
            n = need_now if whole else min(need_now, budget)
            self._extend(batch, req, n)
            budget -= n
            if req.prefilling:  # cut into chunks: the rest follows in the next iterations
                break

    # ------------------------------------------------------------------ memory
    def _output_estimate(self, req: Request) -> float:
        return min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.ratio.value

    def _future_need(self, req: Request) -> float:
        return max(0, req.fill_len - req.kv_len) + self._output_estimate(req)

    def _make_room(
        self, need: Callable[[], int], running: list[Request], retracted: list[Request], keep: set[int]
    ) -> None:
        """Retract running requests (not in `keep`), fewest generated tokens first, until `need()`
        slots are available or nobody is left to retract (a retracted request needs none)."""
        while need() > self.memory.available:
            victims = [r for r in running if id(r) not in keep]
            if not victims:
                return
            victim = min(victims, key=lambda r: self._victim_order(r, running))
            self._retract(victim, running)
            retracted.append(victim)

    def _victim_order(self, req: Request, running: list[Request]) -> tuple:
        """Retracted first: the lowest priority (priority policy), then the fewest generated tokens,
        the longest prompt, the latest admitted."""
        rank = (len(req.output_ids), -req.prompt_len, -running.index(req))
        return (-req.priority, *rank) if self.config.schedule_policy == "priority" else rank

    def _preempt(self, waiting: deque[Request], running: list[Request], retracted: list[Request],
                 keep: set[int]) -> None:
        """Retract running requests of lower priority than the first waiting one (lowest first)
        until it could be admitted: a running place, a request slot (one a retracted request
        still holds frees when its launch in flight returns), and memory for its estimated need."""
        cfg, mem = self.config, self.memory
        head = admission_order(waiting, cfg.schedule_policy, None, cfg.age_bound, cfg.priority_aging_s)[0]
        if head.req_slot is not None:  # a retracted request, waiting for its slot
            return
        tokens = head.fill_ids
        need_now = len(tokens) - (mem.cache.match_len(head.cache_key(tokens)) if mem.cache is not None else 0)
        need = need_now + self._output_estimate(head)
        freeing = sum(1 for r in waiting if r.req_slot is not None)  # slots retracted requests give back
        while True:
            room = len(running) < cfg.max_running_requests and mem.req_slots.num_free + freeing > 0
            reserved = sum(self._future_need(r) for r in running)
            if room and (need_now <= mem.available if not running else need <= mem.available - reserved):
                return
            victims = [r for r in running if id(r) not in keep and r.priority > head.priority]
            if not victims:
                return
            victim = min(victims, key=lambda r: self._victim_order(r, running))
            self._retract(victim, running)
            retracted.append(victim)
            victim.preemptions += 1
            self.preempted[victim.priority] = self.preempted.get(victim.priority, 0) + 1
            if victim.req_slot is not None:
                freeing += 1

    def _retract(self, req: Request, running: list[Request]) -> None:
        running.remove(req)
        self.memory.release(req)  # its KV stays cached while there is room
        req.epoch += 1  # results of its launches in flight are dropped
        if req.wants_prompt_logprobs:  # its prefill starts over, and so do they
            req.prompt_lp.clear()
            req.prompt_top.clear()
        req.pool_sum = None  # and so does its embedding's
        req.num_outputs_launched = len(req.output_ids)
        if req.inflight == 0:
            self.memory.release_req_slot(req)
