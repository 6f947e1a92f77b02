"""What a scheduler agrees on with the other data-parallel replicas every iteration.

The loops talk to one `Agreement`: the base class for a scheduler on its own (nothing to agree
on, no cost), `DPAttention` when the replicas run every MLP together (dp_sync.py). The loops call
`agree` after planning, `decided` with their overlap decision, and `keep_running` to go on.
"""

from __future__ import annotations

import msgspec

from batonlm.device.base import DeviceStream
from batonlm.ipc.device_messages import IdleLaunch
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.dp_sync import DP_IDLE_POLL_S, DPSync

# How long an idle loop blocks on its input before looking again.
IDLE_POLL_S = 0.05


class Agreement:
    """One replica on its own: the batch it planned is what it runs, it ends when it should."""

    # The overlap policy reads the batches' agreed is_extend (`ScheduleBatch.global_is_extend`).
    require_mlp_sync = False
    idle_poll_s = IDLE_POLL_S  # how long the loop blocks on its input when it has nothing to do
    peers_busy = False  # another replica has work: do not block on input

    def agree(self, batch: ScheduleBatch | None, *, done: bool, stop: bool) -> ScheduleBatch | None:
        """After planning: the batch this iteration runs (a falsy one: nothing). `done`: nothing
        left to do and nothing will come; `stop`: shut down now."""
        return batch

    def decided(self, disable_overlap: bool) -> None:
        """The overlap decision this iteration took."""

    def keep_running(self, should_exit: bool) -> bool:
        """Whether the loop goes on (`should_exit`: this scheduler's own view)."""
        return not should_exit

    def stats_fields(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class DPAttention(Agreement):
    """DP attention: every iteration the replicas all-gather a sync row (dp_sync.py). Each
    launch carries every replica's token count; a replica with nothing to run while others have
    work runs an idle launch, and its iteration's batch is an empty one carrying the agreed
    is_extend; the next row carries each overlap decision, checked equal; the loops end
    together."""

    require_mlp_sync = True
    idle_poll_s = DP_IDLE_POLL_S

    def __init__(self, sync: DPSync, device: DeviceStream) -> None:
        self.sync = sync
        self.device = device
        self.peers_busy = False
        self.exit = False

    def agree(self, batch: ScheduleBatch | None, *, done: bool, stop: bool) -> ScheduleBatch | None:
        res = self.sync.exchange(batch, done=done, stop=stop)
        self.peers_busy, self.exit = res.any_work, res.exit
        if batch is not None:
            assert batch.launch is not None  # a planned batch comes with its launch
            batch.global_is_extend = res.global_is_extend
            batch.launch = msgspec.structs.replace(batch.launch, dp_tokens=res.dp_tokens)
            return batch
        if res.any_work:
            self.device.launch_idle(IdleLaunch(res.dp_tokens))
        return ScheduleBatch(batch_id=-1, global_is_extend=res.global_is_extend)

    def decided(self, disable_overlap: bool) -> None:
        self.sync.decided(disable_overlap)

    def keep_running(self, should_exit: bool) -> bool:
        return not self.exit  # decided together, in the last exchange

    def stats_fields(self) -> dict:
        return {"dp_pairings": list(self.sync.pairings), "dp_decisions_checked": self.sync.decisions_checked}

    def close(self) -> None:
        self.sync.close()
