"""`TPGroup`: the ranks of one tensor-parallel model and the collectives its layers call.

Two process groups: the device group (NCCL on GPUs, gloo on the CPU) for the model's
all-reduces and all-gathers, and a gloo CPU group for what the host sends every iteration (the
launch relay, the heartbeat, the divergence check). A single-process group (`TPGroup.single()`)
makes every collective a no-op, so the model code is the same at any size. Every collective is
counted (`counts`), so tests can check a forward issues exactly the collectives designed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    _set_pg_timeout,  # private: the only way to lower a connected group's timeout
)


@dataclass
class CollectiveCounts:
    all_reduce: int = 0
    all_gather: int = 0
    broadcast: int = 0

    def snapshot(self) -> CollectiveCounts:
        return dataclasses.replace(self)


# How long ranks wait for each other to arrive (nodes start at their own pace; loading a model
# takes minutes). Once met, a collective waits at most the group's timeout (--dist-timeout).
RENDEZVOUS_TIMEOUT_S = 600.0


def rendezvous(init_addr: str, rank: int, size: int):
    """The store the ranks meet in: a TCP store rank 0 serves at host:port, or a file store at a
    `file://` path every rank sees."""
    if init_addr.startswith("file://"):
        store = dist.FileStore(init_addr.removeprefix("file://"), size)
        store.set_timeout(timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        return store
    host, _, port = init_addr.rpartition(":")
    return dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))


class TPGroupError(RuntimeError):
    """A collective failed: a rank is gone (its connections closed) or stopped (timed out)."""


def _collective(fn):
    """Run a collective; its failure becomes a TPGroupError saying what it means."""
    try:
        return fn()
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise TPGroupError(f"a tensor-parallel collective failed, a rank is gone or stopped ({first})") from None


class TPGroup:
    def __init__(
        self, rank: int, size: int, device_group=None, cpu_group=None, gather_into_tensor: bool = False, store=None
    ):
        self.rank = rank
        self.size = size
        self.store = store
        self.device_group = device_group
        self.cpu_group = cpu_group
        # NCCL gathers into one tensor (capturable in a CUDA graph); gloo takes a list.
        self._gather_into_tensor = gather_into_tensor
        self.counts = CollectiveCounts()

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def init(cls, rank: int, size: int, init_addr: str, timeout_s: float, device: str) -> TPGroup:
        """Join the group of `size` ranks rendezvousing at `init_addr`: host:port (rank 0
        listens there), or a `file://` path on a file system every rank sees."""
        timeout = timedelta(seconds=timeout_s)
        cuda = device.startswith("cuda")
        if cuda:  # NCCL builds its communicators on the current device
            torch.cuda.set_device(torch.device(device))
        store = rendezvous(init_addr, rank, size)
        # Connecting the ranks waits as long as the rendezvous (ranks start at their own pace: on a
        # busy host one may come seconds after the others); only then do collectives get the short
        # timeout that notices a stopped rank.
        meet = timedelta(seconds=max(RENDEZVOUS_TIMEOUT_S, timeout_s))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size, timeout=meet)
        cpu_group = dist.new_group(backend="gloo", timeout=meet) if cuda else dist.group.WORLD
        for group in {dist.group.WORLD, cpu_group}:
            _set_pg_timeout(timeout, group)
        return cls(rank, size, dist.group.WORLD, cpu_group, gather_into_tensor=cuda, store=store)

    def wait_all(self, key: str) -> None:
        """Wait (up to RENDEZVOUS_TIMEOUT_S, not the collectives' timeout) until every rank has
        called this with `key`: after loading the model, whose time differs from rank to rank."""
        if self.size == 1:
            return
        import time

        self.store.add(key, 1)
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
        while self.store.add(key, 0) < self.size:
            if time.monotonic() > deadline:
                raise TPGroupError(f"tensor-parallel ranks did not all reach {key!r} within {RENDEZVOUS_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self.size == 1:
            return x
        self.counts.all_reduce += 1
        _collective(lambda: dist.all_reduce(x, group=self.device_group))
        return x

    def _gather(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.counts.all_gather += 1
        x = x.contiguous()
        if self._gather_into_tensor:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            _collective(lambda: dist.all_gather_into_tensor(out, x, group=self.device_group))
            return out.unbind(0)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(lambda: dist.all_gather(parts, x, group=self.device_group))
        return tuple(parts)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank r's part at [r * n, (r + 1) * n)."""
        return x if self.size == 1 else torch.cat(self._gather(x), dim=-1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on each rank (the same n) -> [size * n, ...], rank r's rows at [r * n, (r + 1) * n)."""
        return x if self.size == 1 else torch.cat(self._gather(x), dim=0)

    def broadcast_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor to every rank (in place), over the CPU group."""
        self.counts.broadcast += 1
        _collective(lambda: dist.broadcast(x, src=0, group=self.cpu_group))
        return x

    def all_gather_cpu(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's CPU tensor (same shape), over the CPU group."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(lambda: dist.all_gather(parts, x, group=self.cpu_group))
        return parts

    def all_reduce_cpu(self, x: torch.Tensor) -> torch.Tensor:
        _collective(lambda: dist.all_reduce(x, group=self.cpu_group))
        return x

    def destroy(self) -> None:
        if self.size == 1:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
