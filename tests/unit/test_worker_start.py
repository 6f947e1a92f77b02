"""Device workers forked from a fork server (what the test suite's harness uses) start as spawned
ones do: with the starting process's environment and standard streams as they are at the start,
not as they were when the fork server started, and knowing whether their parent is alive."""

from __future__ import annotations

import os
import sys

import pytest

from batonlm import spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver")


def _report(name: str) -> None:
    print(f"env {name}={os.environ.get(name, '<unset>')}", flush=True)
    os.write(2, f"parent gone: {spawn.parent_gone()}\n".encode())


def _run(name: str) -> int | None:
    proc = spawn.worker_process(_report, (name,), "batonlm-test-worker")
    spawn.start(proc)
    proc.join(60)
    return proc.exitcode


@pytest.mark.parametrize("method", spawn.WORKER_START_METHODS)
def test_a_worker_sees_the_environment_and_streams_of_its_start(monkeypatch, capfd, method):
    monkeypatch.setattr(spawn, "_worker_start", method)
    monkeypatch.setenv("BATONLM_TEST_FIRST", "1")
    assert _run("BATONLM_TEST_FIRST") == 0  # the fork server, if any, is running from here on
    first = capfd.readouterr()
    assert "env BATONLM_TEST_FIRST=1" in first.out and "parent gone: False" in first.err
    monkeypatch.setenv("BATONLM_TEST_LATER", "set after the first start")
    monkeypatch.delenv("BATONLM_TEST_FIRST")
    assert _run("BATONLM_TEST_LATER") == 0 and _run("BATONLM_TEST_FIRST") == 0
    later = capfd.readouterr()
    assert "env BATONLM_TEST_LATER=set after the first start" in later.out
    assert "env BATONLM_TEST_FIRST=<unset>" in later.out


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="spawn, forkserver, not 'fork'"):
        spawn.set_worker_start_method("fork")


def test_a_spawned_worker_spins_briefly_unless_the_user_chose(monkeypatch, capfd):
    """libgomp reads GOMP_SPINCOUNT once, in the worker: it must be in the environment the worker
    starts with; the starting process's own environment is left as it was."""
    from batonlm.device.cpu_worker import WORKER_GOMP_SPINCOUNT, worker_openmp_env

    monkeypatch.setattr(spawn, "_worker_start", "spawn")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    proc = spawn.worker_process(_report, ("GOMP_SPINCOUNT",), "batonlm-test-worker")
    with worker_openmp_env():
        spawn.start(proc)
    proc.join(60)
    assert proc.exitcode == 0 and f"env GOMP_SPINCOUNT={WORKER_GOMP_SPINCOUNT}" in capfd.readouterr().out
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    proc = spawn.worker_process(_report, ("GOMP_SPINCOUNT",), "batonlm-test-worker")
    with worker_openmp_env():
        spawn.start(proc)
    proc.join(60)
    assert proc.exitcode == 0 and "env GOMP_SPINCOUNT=123" in capfd.readouterr().out
    assert os.environ["GOMP_SPINCOUNT"] == "123"
