"""Tensor parallelism as a user runs it: `batonlm serve --tp 2` on one node or two, driven over
HTTP; and what happens when a rank dies (kill -9) or hangs (SIGSTOP)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from live_helpers import greedy_completions, wait_until

from batonlm.bench.server_process import ServerProcess, free_port
from batonlm.process_tree import descendants as process_descendants

LONG = {"model": "stories260K", "prompt": "Once", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
        "stream": True}


def _rank_pids(log: str) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", log)}


def _gone(pids) -> bool:
    return not [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/status").read()
    except OSError:
        return "zombie"


class _Stream(threading.Thread):
    """A long streamed completion; records whether it ended in an error event, and when."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.outcome: str | None = None
        self.at = 0.0
        self.events = 0
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base_url + "/v1/completions", json=LONG, timeout=60) as r:
                for line in r.iter_lines():
                    self.events += line.startswith("data:")
                    if '"error"' in line:
                        self.outcome = "error"
                        break
                else:
                    self.outcome = "ended"
        except httpx.HTTPError as e:
            self.outcome = type(e).__name__
        self.at = time.monotonic()


# Four of the {kill, stop} x {rank 0, rank 1} x {decoding, idle} cells, one per way of noticing:
# a collective that fails (kill rank 1 decoding), the heartbeat (kill rank 1 idle), the scheduler's
# pipe (kill rank 0), a collective that times out (stop rank 1). A stopped device worker (rank 0)
# is test_surface_faults.py's (the watchdog).
@pytest.mark.parametrize(("sig", "rank", "busy"), [
    (signal.SIGKILL, 1, True), (signal.SIGKILL, 1, False), (signal.SIGKILL, 0, False), (signal.SIGSTOP, 1, True),
], ids=["kill-rank1-decoding", "kill-rank1-idle (the heartbeat notices)", "kill-rank0-idle (the scheduler notices)",
        "stop-rank1-decoding"])
def test_a_dead_or_hung_rank_takes_the_server_down(sig, rank, busy, one_rank_texts):
    timeout = 3.0
    check = sig == signal.SIGKILL and rank == 1 and busy  # one of them also checks what it serves
    s = ServerProcess("--tp", "2", "--dist-timeout", str(timeout), *(["--debug-tp-check-every", "1"] if check else []))
    try:
        descendants = s.descendants()
        pids = _rank_pids(s.log())
        assert len(pids) == 2
        if check:  # two ranks serve what one rank serves
            assert greedy_completions(s.base_url) == one_rank_texts
        stream = None
        if busy:
            stream = _Stream(s.base_url)
            wait_until(lambda: stream.events >= 20)
        t0 = time.monotonic()
        os.kill(pids[rank], sig)
        limit = 5.0 + (timeout if sig == signal.SIGSTOP else 0.0)
        s.proc.wait(limit + 5.0)
        took = time.monotonic() - t0
        assert s.proc.returncode not in (0, None), s.log()
        assert took < limit, (took, s.log())
        if stream is not None:
            stream.join(5)
            assert stream.outcome == "error" and stream.at - t0 < limit
        wait_until(lambda: _gone(descendants), timeout=5)
    finally:
        s.stop()


def _node(rank: int, addr: str, port: int | None, log, tp: int = 2) -> subprocess.Popen:
    args = [sys.executable, "-m", "batonlm", "serve", "--tp", str(tp), "--nnodes", "2", "--node-rank", str(rank),
            "--dist-init-addr", addr, "--dist-timeout", "3"]
    return subprocess.Popen(args + (["--port", str(port)] if port else []), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize(("ending", "tp"), [
    pytest.param("sigterm-node0", 4, marks=pytest.mark.slow), ("kill-node1-rank", 2),
    pytest.param("stop-node1-rank", 2, marks=pytest.mark.slow),
], ids=["two-ranks-per-node-sigterm-node0", "kill-node1-rank", "stop-node1-rank"])
def test_two_local_nodes_serve_through_node_0(tmp_path, one_rank_texts, ending, tp):
    addr = f"127.0.0.1:{free_port()}"
    log1 = open(tmp_path / "node1.log", "w")
    node1 = _node(1, addr, None, log1, tp)  # started first: it waits for node 0
    s = None
    try:
        s = ServerProcess("--tp", str(tp), "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr,
                          "--dist-timeout", "3")
        first_remote = tp // 2
        wait_until(lambda: f"rank {first_remote} pid" in (tmp_path / "node1.log").read_text(), timeout=10)
        assert len(_rank_pids((tmp_path / "node1.log").read_text())) == tp // 2
        node1_ranks = process_descendants(node1.pid)
        assert greedy_completions(s.base_url) == one_rank_texts
        assert node1.poll() is None
        descendants = s.descendants() + node1_ranks
        if ending == "sigterm-node0":
            assert s.stop() == 0
            assert node1.wait(15) == 0  # rank 0 relayed the shutdown
        else:
            stream = _Stream(s.base_url)
            wait_until(lambda: stream.events >= 20)
            t0 = time.monotonic()
            sig = signal.SIGKILL if ending == "kill-node1-rank" else signal.SIGSTOP
            limit = 5.0 + (3.0 if sig == signal.SIGSTOP else 0.0)  # --dist-timeout 3
            os.kill(_rank_pids((tmp_path / "node1.log").read_text())[1], sig)
            s.proc.wait(limit + 5)
            assert s.proc.returncode not in (0, None) and time.monotonic() - t0 < limit, s.log()
            stream.join(5)
            assert stream.outcome == "error"
            assert node1.wait(limit + 5) == 1
            assert time.monotonic() - t0 < limit, (tmp_path / "node1.log").read_text()
        wait_until(lambda: _gone(descendants), timeout=5)
    finally:
        if s is not None:
            s.stop()
        if node1.poll() is None:
            node1.kill()
        log1.close()
