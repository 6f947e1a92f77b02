"""What a processed result hands each request and sends the frontend: prompt logprobs taken
from a launch's scored positions, and a request's `TokenOutput` for its new token."""

from __future__ import annotations

from batonlm.ipc.device_messages import SampledLogprobs
from batonlm.ipc.messages import TokenOutput
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.request import Request


def take_prompt_logprobs(batch: ScheduleBatch, epochs_ok: list[bool], scored: SampledLogprobs | None) -> None:
    """Append each extend row's share of the launch's prompt logprobs to its request (rows in
    order; a row voided since the launch, by an abort or a retraction, drops its share)."""
    if scored is None:
        return
    at = 0
    for row, n, ok in zip(batch.extend, batch.prompt_logprob_counts, epochs_ok):
        if n and ok:
            req = row.req
            k = req.params.prompt_logprobs or 0
            req.prompt_lp += scored.chosen[at : at + n]
            req.prompt_top += [list(zip(ids[:k], lps[:k], strict=True))
                               for ids, lps in zip(scored.top_ids[at : at + n], scored.top_logprobs[at : at + n])]
        at += n


def token_output(req: Request, tok: int, row: int, lp: SampledLogprobs | None) -> TokenOutput:
    """The frontend's view of `req`'s newest token (row `row` of its batch); the first output
    also says what the cache served, how long it queued, and carries the prompt logprobs."""
    first = len(req.output_ids) == 1
    cached, queued = (req.first_cached_len, req.queued_s) if first else (None, None)
    logprobs = top = None
    n = req.params.logprobs
    if n is not None and lp is not None:
        logprobs = [lp.chosen[row]]
        top = [list(zip(lp.top_ids[row][:n], lp.top_logprobs[row][:n], strict=True))]
    prompt_lp = prompt_top = None
    if first and req.params.prompt_logprobs is not None:
        lead = 1 if req.params.logprob_start_len == 0 else 0  # position 0: nothing precedes it
        prompt_lp = [None] * lead + req.prompt_lp
        prompt_top = [[]] * lead + req.prompt_top
        assert len(prompt_lp) == req.prompt_len - req.params.logprob_start_len, (req, len(prompt_lp))
    return TokenOutput(req.rid, [tok], req.finish_reason, None, logprobs, top, cached, queued, prompt_lp, prompt_top)
