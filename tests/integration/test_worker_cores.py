"""`batonlm serve` with `--cpu-affinity auto` on a machine with a core to spare: the CPU device
worker of stories260K (one thread) runs on the last core, every thread of the frontend and the
scheduler on the others, and the server answers as before."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from batonlm.bench.server_process import ServerProcess
from batonlm.process_tree import children

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                                reason="Linux, two cores or more")


def _affinities(pid: int) -> set[tuple[int, ...]]:
    """The cores each thread of `pid` may run on."""
    return {tuple(sorted(os.sched_getaffinity(int(t.name)))) for t in Path(f"/proc/{pid}/task").iterdir()}


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def test_the_worker_has_the_last_core_and_the_rest_of_the_server_the_others():
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    server = ServerProcess("--cpu-affinity", "auto", "--compile", "off")
    try:
        scheduler = next(p for p in children(server.proc.pid) if "resource_tracker" not in _cmdline(p))
        (worker,) = children(scheduler)
        assert _affinities(worker) == {cpus[-1:]}
        assert _affinities(server.proc.pid) == _affinities(scheduler) == {cpus[:-1]}
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        assert server.stop() == 0
