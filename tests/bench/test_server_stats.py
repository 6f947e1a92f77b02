"""`batonlm bench` reads a speculating server's /metrics before and after a run."""

from __future__ import annotations

import asyncio

import httpx

from batonlm.bench.server_stats import spec_counters, spec_summary


def _metrics(steps: int, accepted: int, drafts: int) -> str:
    return "\n".join([
        "# TYPE batonlm_spec_verify_steps gauge", f'batonlm_spec_verify_steps{{model_name="m"}} {steps}.0',
        "# TYPE batonlm_spec_accepted_tokens gauge", f'batonlm_spec_accepted_tokens{{model_name="m"}} {accepted}.0',
        "# TYPE batonlm_spec_draft_tokens gauge", f'batonlm_spec_draft_tokens{{model_name="m"}} {drafts}.0', ""])


def test_spec_counters_and_their_difference():
    pages = iter([_metrics(10, 5, 30), _metrics(30, 45, 90)])

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics" and request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, text=next(pages))

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await spec_counters(client, "http://x", "k"), await spec_counters(client, "http://x", "k")

    before, after = asyncio.run(run())
    s = spec_summary(before, after)
    # 20 steps accepted 40 drafts: 3 tokens per step.
    assert s == {"spec_verify_steps": 20, "spec_draft_tokens": 60, "spec_accepted_tokens": 40, "spec_accept_length": 3.0}


def test_a_server_that_does_not_speculate_reports_nothing():
    async def run():
        transport = httpx.MockTransport(lambda r: httpx.Response(200, text="# nothing\n"))
        async with httpx.AsyncClient(transport=transport) as client:
            return await spec_counters(client, "http://x", None)

    assert asyncio.run(run()) is None and spec_summary(None, None) is None
