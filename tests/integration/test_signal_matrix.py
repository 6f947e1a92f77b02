"""Signals at any moment: SIGINT (Ctrl-C) or SIGTERM to `batonlm serve` while it loads the model,
compiles the decode step, starts from a warm compile cache, serves idle, serves streams, or
drains (a second signal) — with one rank, `--tp 2` and `--dp 2`. Every time: exit code 0 (a
requested stop), within 10 s, no process left, no traceback; streams in flight finish, or end
with an error event after a second signal. This is a cut of the whole matrix: every phase once
with one rank (the signals alternating, so each is sent in both halves of a start and of
serving), and the paths --tp 2 and --dp 2 add (their start, their drain); `make test` runs
three of these cells (a start, a drain, a --tp 2 start), `make test-all` all of them, and
benchmarks/signal_matrix.py every cell ({SIGINT, SIGTERM} x 6 phases x 3 setups)."""

import signal

import pytest

from batonlm.bench.signal_probe import SETUPS, fill_compile_cache, probe

INT, TERM = signal.SIGINT, signal.SIGTERM
SUITE = {("1 rank", "loading", TERM), ("1 rank", "compiling", TERM), ("1 rank", "draining", INT), ("--tp 2", "loading", INT)}
CASES = [
    ("1 rank", "loading", INT), ("1 rank", "compiling", TERM), ("1 rank", "warm", INT), ("1 rank", "idle", TERM),
    ("1 rank", "load", INT), ("1 rank", "draining", INT), ("1 rank", "loading", TERM),
    # (SIGTERM under load, streams finishing or ended: test_reliability.py's sigterm tests; SIGTERM
    # when idle also stood in test_server_lifecycle.py, which now leaves it to this matrix)
    # --tp 2 has no compiled decode step (its collectives are not compiled): no compile phases.
    ("--tp 2", "loading", INT), ("--tp 2", "draining", TERM),
    ("--dp 2", "loading", TERM), ("--dp 2", "draining", INT),
]
CELLS = [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2].name}", marks=() if c in SUITE else pytest.mark.slow)
         for c in CASES]


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("compile-cache"))
    fill_compile_cache(cache)
    return cache


@pytest.mark.parametrize(("setup", "phase", "sig"), CELLS)
def test_a_signal_at_any_moment_stops_everything(setup, phase, sig, request):
    cache = request.getfixturevalue("warm_cache") if phase == "warm" else None
    o = probe(phase, sig, SETUPS[setup], setup_name=setup, compile_cache=cache)
    assert o.exit_code == 0, o.log
    assert o.exit_s <= 10.0, (o.exit_s, o.log)
    assert o.left == [], f"processes left: {o.left}\n{o.log}"
    assert not o.traceback, o.log  # nor a leaked semaphore (tqdm's lock in a killed worker did)
    if phase == "load":  # the drain lets them finish (5 s), then ends them with an error event
        assert len(o.streams) == 4 and set(o.streams) <= {"done", "error"}, o.streams
    elif phase == "draining":  # a second signal: what still runs ends with an error event, no cut stream
        assert len(o.streams) == 4 and set(o.streams) <= {"done", "error"}, o.streams
    else:
        assert o.streams == []
    if phase == "warm":
        assert "compiling the decode step" in o.log
