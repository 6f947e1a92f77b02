"""--schedule-policy priority on a real scheduler driven iteration by iteration (SchedulerHarness):
a high-priority arrival is admitted before queued low ones; with --enable-priority-preemption it
retracts a running low one, which resumes later with exactly its solo output (both loops); the
preemptions are counted per request and per priority; aging admits a starved request."""

from __future__ import annotations

import pytest
from helpers import SchedulerHarness

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = [1, 300, 301, 302]


def _finish_order(h: SchedulerHarness, overlap: bool) -> tuple[list[str], dict]:
    order: list[str] = []
    preempted: dict[str, int] = {}

    def watch(msg) -> None:
        for o in msg.outputs:
            if o.finish_reason:
                order.append(o.rid)
                preempted[o.rid] = o.preemptions

    h.io.on_output = watch
    records = h.run(overlap=overlap)
    h.io.on_output = None
    assert all(r.finish_reason == "length" for r in records.values())
    return order, {"records": records, "preempted": preempted}


@pytest.fixture(scope="module")
def harness(stories_path):
    h = SchedulerHarness(stories_path, schedule_policy="priority", max_running_requests=1)
    yield h
    h.close()


def test_a_high_priority_arrival_goes_before_queued_low_ones(harness):
    """One request runs at a time: low0 runs, low1-3 queue, then high arrives; it is admitted
    next. Under fcfs (every priority 0: the same policy) it would be last."""
    h = harness
    for priority_of_high, expected in ((-1, ["low0", "high", "low1", "low2", "low3"]),
                                      (0, ["low0", "low1", "low2", "low3", "high"])):
        h.submit("low0", PROMPT, {**GREEDY, "max_new_tokens": 8}, priority=5)
        for i in (1, 2, 3):
            h.submit(f"low{i}", PROMPT + [i], {**GREEDY, "max_new_tokens": 4}, at=1, priority=5 if priority_of_high else 0)
        h.submit("high", PROMPT + [9], {**GREEDY, "max_new_tokens": 4}, at=2, priority=priority_of_high)
        order, _ = _finish_order(h, overlap=True)
        assert order == expected
        h.assert_all_free()


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_retracts_a_running_low_request_which_resumes_unchanged(harness, overlap):
    h = harness
    h.submit("low", PROMPT, {**GREEDY, "max_new_tokens": 40}, priority=3)
    solo = h.run(overlap)["low"].token_ids
    h.reconfigure(enable_priority_preemption=True)
    h.submit("low", PROMPT, {**GREEDY, "max_new_tokens": 40}, priority=3)
    h.submit("high", [1, 400, 401], {**GREEDY, "max_new_tokens": 6}, at=10, priority=-2)
    order, seen = _finish_order(h, overlap)
    assert order == ["high", "low"]  # without preemption one request at a time would finish low first
    assert seen["records"]["low"].token_ids == solo
    assert seen["preempted"] == {"high": 0, "low": 1}
    assert h.sched.stats().preemptions == {"3": 1}
    h.assert_all_free()
    # Without preemption: queued, not preempting.
    h.reconfigure(enable_priority_preemption=False)
    h.submit("low", PROMPT, {**GREEDY, "max_new_tokens": 40}, priority=3)
    h.submit("high", [1, 400, 401], {**GREEDY, "max_new_tokens": 6}, at=10, priority=-2)
    order, seen = _finish_order(h, overlap)
    assert order == ["low", "high"] and seen["preempted"] == {"high": 0, "low": 0}
    h.assert_all_free()


def test_aging_admits_a_starved_request(harness):
    """With --priority-aging-s tiny every waiting request is aged at once: arrival order wins
    over priority (the exact bound is shown on a fake clock in tests/unit/test_schedule_policy.py)."""
    h = harness
    h.reconfigure(priority_aging_s=1e-9, enable_priority_preemption=False)
    h.submit("low0", PROMPT, {**GREEDY, "max_new_tokens": 8}, priority=5)
    h.submit("low1", PROMPT + [1], {**GREEDY, "max_new_tokens": 4}, at=1, priority=5)
    h.submit("high", PROMPT + [9], {**GREEDY, "max_new_tokens": 4}, at=2, priority=-1)
    order, _ = _finish_order(h, overlap=True)
    assert order == ["low0", "low1", "high"]
    h.reconfigure(priority_aging_s=60.0)


def test_every_route_takes_a_priority(guarded_server):
    """On a server with the priority policy each route accepts `priority` (the bad-input corpus
    shows the 400 on one without), and /generate's meta_info counts the request's preemptions."""
    import anthropic
    import httpx
    import openai

    url, key = guarded_server.base_url, "sekrit"
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(url + "/generate", headers=auth, timeout=60,
                   json={"text": "Once", "priority": -4, "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and r.json()["meta_info"]["preemptions"] == 0, r.text
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Once"}],
                                          max_tokens=3, extra_body={"priority": 7})
    assert chat.usage.completion_tokens == 3
    done = client.completions.create(model="stories260K", prompt="Once", max_tokens=3, extra_body={"priority": 1})
    assert done.usage.completion_tokens == 3
    response = client.responses.create(model="stories260K", input="Once", max_output_tokens=3,
                                       extra_body={"priority": 2})
    assert response.usage.output_tokens == 3
    message = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0).messages.create(
        model="stories260K", max_tokens=3, messages=[{"role": "user", "content": "Once"}], extra_body={"priority": -1})
    assert message.usage.output_tokens == 3
    metrics = httpx.get(url + "/metrics", headers=auth, timeout=30).text
    assert "batonlm_scheduler_preemptions" in metrics
