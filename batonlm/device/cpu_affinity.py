"""CPU cores for the device worker and for the rest of the server.

Where the CPU device worker's intra-op threads leave cores free (one replica of a tiny model:
one thread), the OS may still run the worker and a busy process of the server (the scheduler,
the frontend) on one core now and then, each then waiting for the other: stories260K's median
ITL went 0.27 -> 0.52 ms for several rounds at a time on a 2-core machine, and stayed at
0.25-0.34 ms with the worker on its own core and the rest on the other (docs/benchmarks.md).
So the worker takes the last `threads` of the cores this process may use, and the scheduler and
the frontend (not a process that embeds an Engine) keep off them. Linux only; `--cpu-affinity
off` leaves every process where the OS puts it.
"""

from __future__ import annotations

import os


def available_cpus() -> list[int]:
    """The cores this process may run on (a `taskset` or a container's cpuset narrows them; not
    Linux: none known)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def worker_cpus(threads: int) -> tuple[int, ...]:
    """The cores the device worker keeps for its `threads` threads: the last of those this
    process may use; none (no pinning) where its threads take them all."""
    cpus = available_cpus()
    return tuple(cpus[-threads:]) if 0 < threads < len(cpus) else ()


def _pin(cpus: set[int]) -> None:
    """Every thread of this process on `cpus` (threads started later inherit it)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that has just exited
            pass


def take(cpus: tuple[int, ...]) -> None:
    """The device worker: run on `cpus` (none: anywhere)."""
    if cpus:
        _pin(set(cpus))


def keep_off(cpus: tuple[int, ...] | list[int]) -> None:
    """The scheduler and the frontend: run on every core this process may use but the worker's."""
    rest = set(available_cpus()) - set(cpus)
    if cpus and rest:
        _pin(rest)
