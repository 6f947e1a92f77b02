"""The CPU device worker's own cores (cpu_affinity.py): the last `threads` of those the server
may use where its threads leave some free, none where they take them all; pinning moves every
thread of a process, those started before and after it."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

import pytest

from batonlm.device import cpu_affinity

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux affinity")


def test_the_worker_keeps_the_last_cores_its_threads_need(monkeypatch):
    monkeypatch.setattr(cpu_affinity, "available_cpus", lambda: [0, 2, 5, 7])
    assert cpu_affinity.worker_cpus(1) == (7,)
    assert cpu_affinity.worker_cpus(3) == (2, 5, 7)
    assert cpu_affinity.worker_cpus(4) == () and cpu_affinity.worker_cpus(8) == ()  # every core: no pinning


def test_a_larger_models_worker_takes_the_cores_this_process_may_use(monkeypatch):
    """Not the machine's count: under `taskset -c 0,2` two threads, not os.cpu_count()'s."""
    from types import SimpleNamespace

    from batonlm.device.spec import MULTITHREAD_MIN_HIDDEN, cpu_worker_threads

    monkeypatch.setattr(cpu_affinity, "available_cpus", lambda: [0, 2])
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert cpu_worker_threads(SimpleNamespace(hidden_size=MULTITHREAD_MIN_HIDDEN)) == 2
    assert cpu_worker_threads(SimpleNamespace(hidden_size=MULTITHREAD_MIN_HIDDEN - 1)) == 1


def _threads_affinity(worker_cpus: list[int], out) -> None:
    before = threading.Event()
    done = threading.Event()
    seen: dict[str, list[int]] = {}

    def early() -> None:  # a thread started before the pinning (a ZMQ or executor thread)
        before.set()
        done.wait(10)
        seen["before"] = sorted(os.sched_getaffinity(0))

    t = threading.Thread(target=early)
    t.start()
    before.wait(10)
    cpu_affinity.keep_off(worker_cpus)
    late = threading.Thread(target=lambda: seen.setdefault("after", sorted(os.sched_getaffinity(0))))
    late.start()
    late.join()
    done.set()
    t.join()
    out.put({"main": sorted(os.sched_getaffinity(0)), **seen})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_keeping_off_the_workers_cores_moves_every_thread():
    cpus = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_threads_affinity, args=([cpus[-1]], out))
    p.start()
    seen = out.get(timeout=60)
    p.join(10)
    assert seen == {"main": cpus[:-1], "before": cpus[:-1], "after": cpus[:-1]}
