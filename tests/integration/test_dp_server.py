"""Data parallelism as a user runs it: `batonlm serve --dp 2` (two replicas, requests routed by
prefix or in turns) and `--enable-dp-attention`, driven over HTTP with the openai client."""

import os
import signal
import time

import httpx
import pytest
from live_helpers import greedy_completions, wait_until

from batonlm.bench.server_process import ServerProcess
from batonlm.process_tree import children

# A prompt long enough for the prefix cache (and the router's 16-token blocks) to matter.
SYSTEM = ("Once upon a time there was a tiny frog who lived in a pond. Every day he would jump from leaf to leaf "
          "and sing a happy song. The other animals liked his song very much.")


def _cached(base_url: str, prompt: str) -> int:
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    usage = httpx.post(base_url + "/v1/completions", json=body, timeout=30).json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("flags", [("--dp", "2"), ("--dp", "2", "--enable-dp-attention")],
                         ids=["replicas", "dp-attention"])
def test_two_replicas_serve_what_one_serves(one_rank_texts, flags):
    s = ServerProcess(*flags)
    try:
        if "--enable-dp-attention" not in flags:  # --load-balance-method prefix is the default
            # A shared prompt stays on the replica that cached it. (Round robin would send the
            # second request to the other replica, whose cache is empty: tests/unit/test_dp_router.py
            # covers the methods' choices.)
            _cached(s.base_url, SYSTEM + " One day")
            assert all(_cached(s.base_url, SYSTEM + f" Then {i}") > 16 for i in range(4))
        assert greedy_completions(s.base_url) == one_rank_texts
        assert "dp 2" in s.log()
        # Concurrent requests spread over both replicas and all finish.
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda _: greedy_completions(s.base_url), range(4)))
        assert all(t == one_rank_texts for t in texts)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("victim", ["dp-attention-worker", "replica-scheduler"])
def test_a_dead_replica_takes_the_server_down(victim):
    """kill -9 of one replica's device worker (DP attention), or of one replica's scheduler
    (plain --dp: the frontend's shutdown refused to tell the live replica, so the frontend never
    exited and that replica's processes stayed)."""
    flags = ("--enable-dp-attention", "--dist-timeout", "3") if victim == "dp-attention-worker" else ()
    s = ServerProcess("--dp", "2", *flags)
    try:
        descendants = s.descendants()
        workers = [w for p in _schedulers(s) for w in children(p)]  # the device workers
        t0 = time.monotonic()
        os.kill(workers[-1] if victim == "dp-attention-worker" else _schedulers(s)[-1], signal.SIGKILL)
        s.proc.wait(10)
        assert s.proc.returncode not in (0, None) and time.monotonic() - t0 < 5.0, s.log()
        wait_until(lambda: not [p for p in descendants if os.path.exists(f"/proc/{p}")
                                and "zombie" not in open(f"/proc/{p}/status").read()], timeout=5)
    finally:
        s.stop()


def _schedulers(s: ServerProcess) -> list[int]:
    """The main process's children that are scheduler processes (not multiprocessing's
    resource tracker), in start order."""
    def cmdline(pid: int) -> str:
        try:
            return open(f"/proc/{pid}/cmdline").read()
        except OSError:
            return ""

    return sorted(p for p in children(s.proc.pid) if "resource_tracker" not in cmdline(p))
