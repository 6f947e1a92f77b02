import pytest

from batonlm.bench.server_process import ServerProcess


@pytest.fixture(scope="session")
def server():
    """One live server on the embedded model for the whole session."""
    s = ServerProcess()
    yield s
    code = s.stop()
    assert code == 0, f"server exited with {code}:\n{s.log()}"


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def one_rank_texts(server):
    """What one rank serves (the session server): the scale-out tests' reference."""
    from live_helpers import greedy_completions

    return greedy_completions(server.base_url)
