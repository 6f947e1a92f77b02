"""What the server says about a run (its /metrics, read before and after): speculative
decoding's verification steps and accepted drafts, when the server speculates."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

SPEC_GAUGES = ("batonlm_spec_verify_steps", "batonlm_spec_accepted_tokens", "batonlm_spec_draft_tokens")


async def spec_counters(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> dict[str, float] | None:
    """The speculative decoding gauges now (None: the server does not speculate, or has no
    /metrics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.get(f"{base_url.rstrip('/')}/metrics", headers=headers)
        r.raise_for_status()
    except (httpx.HTTPError, OSError):
        return None
    found = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples
             if s.name in SPEC_GAUGES}
    return found if len(found) == len(SPEC_GAUGES) else None


def spec_summary(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None] | None:
    """Verification steps, drafts and accepted drafts during the run, and tokens per step."""
    if after is None:
        return None
    before = before or dict.fromkeys(SPEC_GAUGES, 0.0)
    steps, accepted, drafts = (after[k] - before[k] for k in SPEC_GAUGES)
    if steps <= 0:
        return {"spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_accept_length": None}
    return {"spec_verify_steps": steps, "spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
            "spec_accept_length": (steps + accepted) / steps}
