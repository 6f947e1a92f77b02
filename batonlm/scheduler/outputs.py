"""What a processed result hands each request and sends the frontend: prompt logprobs taken
from a launch's scored positions, a verifying row's accepted drafts, the tokens appended up to
a finish, and a request's `TokenOutput` for its new tokens."""

from __future__ import annotations

from batonlm.ipc.device_messages import SampledLogprobs
from batonlm.ipc.messages import ABOUT_CONSTRAINT, TokenOutput
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.grammar_queue import GrammarQueue
from batonlm.scheduler.request import FINISH_ABORT, Request


def take_prompt_logprobs(batch: ScheduleBatch, scored: SampledLogprobs | None) -> None:
    """Append each extend row's share of the launch's prompt logprobs to its request (rows in
    order; a row voided since the launch, by an abort or a retraction, drops its share)."""
    if scored is None:
        return
    at = 0
    for row, n, epoch in zip(batch.extend, batch.prompt_logprob_counts, batch.epochs):
        req = row.req
        if n and not req.finished and epoch == req.epoch:
            k = req.params.prompt_logprobs or 0
            req.prompt_lp += scored.chosen[at : at + n]
            req.prompt_top += [list(zip(ids[:k], lps[:k], strict=True))
                               for ids, lps in zip(scored.top_ids[at : at + n], scored.top_logprobs[at : at + n])]
        at += n


def take_pooled(batch: ScheduleBatch, pooled: list[list[float]] | None) -> None:
    """Add each pooling extend row's summed hidden states to its request's embedding (a row
    voided since the launch drops its share)."""
    if pooled is None:
        return
    sums = iter(pooled)
    for row, pools, epoch in zip(batch.extend, batch.pooled_rows, batch.epochs):
        if pools:
            values = next(sums)
            if not row.req.finished and epoch == row.req.epoch:
                row.req.add_pooled(values)


def verified_rows(batch: ScheduleBatch, accepted: list[int] | None) -> dict[int, int]:
    """Per verifying row (of `batch`): the drafts the device accepted. Its launch rows then hold
    the tokens it emits: the accepted drafts and the token after them."""
    launch = batch.launch
    if launch is None or not launch.verify_groups:
        return {}
    assert accepted is not None
    rows = [i for i, d in enumerate(batch.drafts) if d]  # verifying decode rows, in launch order
    return {len(batch.extend) + i: a for i, a in zip(rows, accepted, strict=True)}


def emit(req: Request, tokens: list[int]) -> list[int]:
    """Append `tokens` to `req` in order until one finishes it; returns those appended (a stop
    inside an accepted run of drafts ends the request there)."""
    emitted = []
    for tok in tokens:
        if req.matcher is not None and not GrammarQueue.advance(req, tok):
            # Its grammar allowed no token here (a dead end: every token was masked), so the
            # sampler's pick does not fit; the request ends with an error, not ungrammatical text.
            req.finish_reason, req.error_about = FINISH_ABORT, ABOUT_CONSTRAINT
            req.error = (f"the output's constraint admits no token after the {len(req.output_ids)} generated "
                         "(its grammar has a dead end there)")
            break
        req.output_ids.append(tok)
        emitted.append(tok)
        req.check_finished()
        if req.finished:
            break
    return emitted


def token_output(req: Request, tokens: list[int], lp: SampledLogprobs | None, lp_at: int) -> TokenOutput:
    """The frontend's view of `req`'s new tokens (their logprobs at lp_at.. of `lp`); the first
    output also says what the cache served, how long it queued, and carries the prompt logprobs."""
    first = len(req.output_ids) == len(tokens)
    cached, queued = (req.first_cached_len, req.queued_s) if first else (None, None)
    logprobs = top = None
    n = req.params.logprobs
    if n is not None and lp is not None:
        at = range(lp_at, lp_at + len(tokens))
        logprobs = [lp.chosen[i] for i in at]
        top = [list(zip(lp.top_ids[i][:n], lp.top_logprobs[i][:n], strict=True)) for i in at]
    prompt_lp: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    if first and req.params.prompt_logprobs is not None:
        lead = 1 if req.params.logprob_start_len == 0 else 0  # position 0: nothing precedes it
        prompt_lp = [None] * lead + req.prompt_lp
        prompt_top = [[]] * lead + req.prompt_top
        assert len(prompt_lp) == req.prompt_len - req.params.logprob_start_len, (req, len(prompt_lp))
    spec = (req.spec.steps, req.spec.accepted) if req.finished and req.spec is not None and req.spec.steps else None
    return TokenOutput(req.rid, tokens, req.finish_reason, req.error, logprobs, top, cached, queued, prompt_lp, prompt_top,
                       spec, req.preemptions if req.finished else 0, req.embedding if first else None,
                       req.error_about)
