"""Admission is counted at arrival: requests that arrive together cannot all take the last room,
and a request that can never fit is a 400, not a 429 a client would retry for ever."""

import asyncio

import pytest

from batonlm.config import ServerArgs
from batonlm.ipc.messages import SchedulerInfo
from batonlm.request_checks import RequestRejected
from batonlm.server.openai_completions import CompletionsRoute
from batonlm.server.pipeline import Job
from batonlm.server.protocol import CompletionRequest
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.manager import TokenizerManager
from batonlm.tokenizer_manager.request_state import QueueFull
from batonlm.tokenizer_manager.token_bytes import TokenBytes
from batonlm.tokenizer_manager.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return load_tokenizer(stories_path)


def _state(tokenizer, **limits) -> ServerState:
    args = ServerArgs(**limits)
    manager = TokenizerManager(args, tokenizer, launch=None)  # not started: admission needs no scheduler
    manager.info = SchedulerInfo("stories", context_length=100_000, vocab_size=512, kv_capacity=1_000_000,
                                 device="cpu", dtype="float32", overlap=True)
    manager.healthy = True
    return ServerState(args, manager, None, TokenBytes(tokenizer), "stories260K", 0)  # type: ignore[arg-type]


def test_simultaneous_arrivals_take_the_room_one_by_one(tokenizer):
    """20 requests prepared at once (each tokenizes a long prompt in a thread, so they interleave)
    while at most 1 + 2 may be in flight: exactly 3 are admitted."""
    state = _state(tokenizer, max_running_requests=1, max_queued_requests=2)
    route = CompletionsRoute()
    long_prompt = "Once upon a time there was a little girl. " * 250  # > 8192 characters: tokenized off the loop
    reqs = [CompletionRequest(prompt=long_prompt, max_tokens=4) for _ in range(20)]

    async def arrive():
        return await asyncio.gather(*(route.prepare(state, r) for r in reqs), return_exceptions=True)

    outcomes = asyncio.run(arrive())
    admitted = [o for o in outcomes if isinstance(o, Job)]
    assert len(admitted) == 3
    assert all(isinstance(o, QueueFull) for o in outcomes if not isinstance(o, Job))
    # The room comes back when an admitted request gives it back (ends, fails, or is never sent).
    admitted[0].admission.release()
    admitted[0].admission.release()  # twice: harmless
    job = asyncio.run(route.prepare(state, reqs[0]))
    assert isinstance(job, Job)
    with pytest.raises(QueueFull):
        asyncio.run(route.prepare(state, reqs[0]))


def test_a_request_that_fails_after_admission_gives_its_room_back(tokenizer):
    state = _state(tokenizer, max_running_requests=1, max_queued_requests=1)
    route = CompletionsRoute()
    too_long = CompletionRequest(prompt=[1] * 10, max_tokens=200_000)  # beyond the context
    for _ in range(5):
        with pytest.raises(Exception, match="maximum context length"):
            asyncio.run(route.prepare(state, too_long))
    assert state.manager._reserved == 0
    jobs = [asyncio.run(route.prepare(state, CompletionRequest(prompt=[1, 2], max_tokens=2))) for _ in range(2)]
    assert len(jobs) == 2


def test_more_choices_than_can_ever_be_in_flight_is_a_400_naming_the_prompt(tokenizer):
    state = _state(tokenizer, max_running_requests=4, max_queued_requests=12)
    route = CompletionsRoute()
    with pytest.raises(RequestRejected, match="can never be admitted") as e:
        asyncio.run(route.prepare(state, CompletionRequest(prompt=["Once"] * 4, n=5)))
    assert e.value.param == "prompt"
    assert state.manager._reserved == 0
    assert isinstance(asyncio.run(route.prepare(state, CompletionRequest(prompt=["Once"] * 4, n=4))), Job)
