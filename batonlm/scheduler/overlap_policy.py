"""When the overlap loop must process the previous result before launching the next batch."""

from __future__ import annotations

import os

from batonlm.scheduler.batch import ScheduleBatch

DISABLE_CONSECUTIVE_PREFILL_ENV = "BATONLM_DISABLE_CONSECUTIVE_PREFILL_OVERLAP"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def batch_is_extend(batch: ScheduleBatch | None, require_mlp_sync: bool) -> bool:
    """Whether `batch` computes prompt tokens. Under data parallelism (`require_mlp_sync`) the
    flag all ranks agreed on decides, so that every rank takes the same path."""
    if batch is None:
        return False
    if require_mlp_sync:
        if batch.global_is_extend is None:
            raise ValueError("require_mlp_sync is set but the batch carries no globally agreed is_extend flag")
        return batch.global_is_extend
    return batch.is_extend


def is_disable_overlap_for_batch(
    batch: ScheduleBatch | None,
    last_batch: ScheduleBatch | None,
    *,
    disable_consecutive_prefill: bool,
    result_queued: bool,
    require_mlp_sync: bool = False,
) -> bool:
    """True when (a) this and the last batch both prefill and the consecutive-prefill switch is
    on (the second prefill's TTFT would otherwise wait on the first one's processing), or (b) a
    speculative decode batch uses a grammar while a result is still queued (its masks need it)."""
    consecutive_prefill = (
        disable_consecutive_prefill
        and batch_is_extend(batch, require_mlp_sync)
        and batch_is_extend(last_batch, require_mlp_sync)
    )
    spec_grammar = batch is not None and batch.is_speculative and batch.has_grammar and result_queued
    return consecutive_prefill or spec_grammar


def must_process_before_planning(last_batch: ScheduleBatch | None) -> bool:
    """Speculative decoding in the overlap loop: a batch that verified drafts has its result
    processed before the next batch is planned — how many drafts were accepted decides the
    positions and KV slots of its requests' next rows. (Drafts themselves need no result: with
    the newest output in flight they are looked up one token behind.)"""
    return last_batch is not None and last_batch.is_speculative
