import os
from pathlib import Path

import pytest
from live_helpers import BATONLM

from batonlm.bench.server_process import ServerProcess


@pytest.fixture(scope="session")
def server():
    """One live server on the embedded model for the whole session, started as the README's first
    command starts it (the console script, no other argument), so that test_readme.py uses it as
    the README's server; `python -m batonlm serve` where the package is not installed."""
    s = ServerProcess(command=[BATONLM, "serve"] if Path(BATONLM).exists() else None)
    yield s
    code = s.stop()
    assert code == 0, f"server exited with {code}:\n{s.log()}"
    # Its log is kept in memory and its file removed: a start per test left hundreds in /tmp.
    assert not s.log_path.exists() and "batonlm stopped (exit code 0)" in s.log()


@pytest.fixture(scope="session")
def guarded_server():
    """A server with an API key (`sekrit`, from $BATONLM_API_KEY: off the command line), a
    2000-byte cap on request bodies, an 8 KiB budget for whole answers, no prefix cache and the
    priority policy: test_server_errors.py checks the first three, test_server_cache.py the
    fourth, test_priority_scheduling.py the last (with every priority 0 it is arrival order).
    None of them changes what the others do, so one server serves all."""
    os.environ["BATONLM_API_KEY"] = "sekrit"
    try:
        s = ServerProcess("--max-request-bytes", "2000", "--max-response-bytes", "8192", "--disable-radix-cache",
                          "--schedule-policy", "priority")
    finally:
        del os.environ["BATONLM_API_KEY"]
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def one_rank_texts(server):
    """What one rank serves (the session server): the scale-out tests' reference."""
    from live_helpers import greedy_completions

    return greedy_completions(server.base_url)
