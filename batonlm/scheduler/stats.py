"""`SchedulerStats`: one scheduler's counters, as `/metrics` and `Engine.stats()` read them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batonlm.ipc.messages import SchedulerStats

if TYPE_CHECKING:
    from batonlm.scheduler.scheduler import Scheduler


def scheduler_stats(sched: Scheduler) -> SchedulerStats:
    mem = sched.memory
    return SchedulerStats(
        num_running=sum(1 for r in sched.running if not r.finished),
        num_waiting=len(sched.waiting),
        kv_used=mem.in_use,
        kv_capacity=mem.capacity,
        kv_evictable=mem.evictable,
        cached_prompt_tokens=mem.cached_tokens,
        admitted_prompt_tokens=mem.admitted_tokens,
        retractions=sched.planner.num_retractions,
        req_slots_used=mem.req_slots.num_used,
        req_slots_total=mem.req_slots.capacity,
        iterations=sched.iteration,
        prompt_tokens=sched.prompt_tokens,
        generated_tokens=sched.generated_tokens,
        scheduler_cpu_s=sched.timing.cpu_s,
        device_wait_s=sched.timing.wait_s,
        device_compute_s=sched.device.compute_s,
        batches=sched.timing.batches,
        dp_rank=sched.config.dp_rank,
        dp_pairings=list(sched.dp_sync.pairings) if sched.dp_sync is not None else [],
        dp_decisions_checked=sched.dp_sync.decisions_checked if sched.dp_sync is not None else 0,
        **(sched.speculator.stats.as_fields() if sched.speculator is not None else {}),
    )
