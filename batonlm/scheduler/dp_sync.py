"""DP attention's per-iteration sync: the data-parallel schedulers agree on what runs.

Each replica plans its own batch, but their devices run every layer's MLP together (each holds
part of it), so every iteration all of them must launch something — a batch, or an idle launch —
and agree on how many tokens each brings. After planning, each scheduler all-gathers a sync row
over a gloo group of the schedulers: its token count, whether its batch extends (computes prompt
tokens), whether it wants to stop, and the overlap decision it took last iteration. From the rows:
* every rank's token count goes into the launch (`BatchLaunch.dp_tokens`), and a rank with no
  batch while others have one runs an idle launch;
* `global_is_extend` (any rank extends) is what the overlap policy reads (`require_mlp_sync`), so
  every rank takes the same overlap decision — and the next row carries it, checked equal on all
  ranks (`DPDivergenceError` otherwise);
* the loops end together: when any rank is shut down (or orphaned), or when every rank is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from batonlm.distributed.group import rendezvous
from batonlm.scheduler.batch import ScheduleBatch

IDLE, EXTEND, DECODE = 0, 1, 2
# How long an idle replica blocks on its input: all replicas wait for the slowest to reach the
# sync, so a new request on one waits up to this long for the others (each idle sync costs a
# gloo all-gather, ~0.3 ms on the CPU).
DP_IDLE_POLL_S = 0.01
KINDS = ("idle", "extend", "decode")
_NONE = -1  # no overlap decision yet


class DPDivergenceError(RuntimeError):
    """The data-parallel schedulers did not take the same overlap decision."""


@dataclass(frozen=True)
class SyncResult:
    dp_tokens: list[int]
    global_is_extend: bool
    any_work: bool
    exit: bool


def batch_kind(batch: ScheduleBatch | None) -> int:
    if batch is None:
        return IDLE
    return EXTEND if batch.is_extend else DECODE


def launch_tokens(batch: ScheduleBatch) -> int:
    """The tokens the batch's launch computes (its flat forward length)."""
    assert batch.launch is not None
    return sum(batch.launch.extend_lens)


class DPSync:
    def __init__(self, dp_rank: int, dp_size: int, init_method: str, timeout_s: float) -> None:
        dist.init_process_group("gloo", store=rendezvous(init_method, dp_rank, dp_size), rank=dp_rank,
                                world_size=dp_size, timeout=timedelta(seconds=timeout_s))
        self.rank = dp_rank
        self.size = dp_size
        self.last_decision = _NONE
        self.iterations = 0
        # pairings[mine * 3 + other]: iterations this rank ran `mine` while another ran `other`.
        self.pairings = [0] * 9
        self.decisions_checked = 0

    def exchange(self, batch: ScheduleBatch | None, done: bool, stop: bool) -> SyncResult:
        """All-gather this iteration's row: `done` (nothing left to do, nothing will come),
        `stop` (shut down now)."""
        kind = batch_kind(batch)
        row = torch.tensor([launch_tokens(batch) if batch is not None else 0, kind, int(done), int(stop),
                            self.last_decision], dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.size)]
        dist.all_gather(rows, row)
        table = torch.stack(rows).tolist()
        decisions = {r[4] for r in table}
        if len(decisions) > 1:
            raise DPDivergenceError(f"data-parallel ranks took different overlap decisions last iteration: "
                                    f"{[r[4] for r in table]}")
        if self.last_decision != _NONE:
            self.decisions_checked += 1
        self.iterations += 1
        for r, other in enumerate(table):
            if r != self.rank:
                self.pairings[kind * 3 + other[1]] += 1
        tokens = [r[0] for r in table]
        return SyncResult(
            dp_tokens=tokens,
            global_is_extend=any(r[1] == EXTEND for r in table),
            any_work=any(tokens),
            exit=any(r[3] for r in table) or all(r[2] for r in table),
        )

    def decided(self, disable_overlap: bool) -> None:
        """The overlap decision this iteration took: the next row carries it for the check."""
        self.last_decision = int(disable_overlap)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
