"""Speculative decoding with n-gram drafts (prompt lookup): a request's next tokens are guessed
from its own prompt and output, and the model verifies the guesses in one forward.

`NgramIndex` maps each n-gram (n in min_n..max_n) of a request's tokens to where its latest
occurrence was followed, updated as tokens arrive; a draft is what followed the latest earlier
occurrence of the longest n-gram that ends the sequence. `Speculator` decides, per request and
step, how many tokens to draft: up to `num_draft_tokens`, adapted from the request's own
acceptance (all accepted: one more next time; a miss: as many as were accepted, plus one), only
when the tokens a verification is expected to emit beat its measured cost (see `Speculator`),
and nobody drafts while more than `disable_batch_size` requests decode. Requests with penalties
or logit bias do not draft (their logits at a draft position would depend on the drafts before
it); constrained ones do, their masks following the drafts.

Verification happens on the device (`batonlm.device.batch_executor`): each position's token is
sampled exactly as a plain decode step would sample it (same seed, same output index), and a
draft is accepted while it equals that token. With deterministic drafts this is the rejection
sampling of speculative decoding (q one-hot: accept with probability p(draft)), and it makes a
speculative run emit exactly the tokens a plain run emits, seeded or greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batonlm.sampling_params import LogitChanges

MAX_PAUSE_STEPS = 16
DRAFT_ON_DEVICE = -1  # a draft token the draft model writes on the device


@dataclass(frozen=True)
class SpecConfig:
    num_draft_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    disable_batch_size: int = 8
    # Drafts from the draft model on the device (the host sends DRAFT_ON_DEVICE placeholders).
    draft_model: bool = False
    # What a verification step costs in plain decode steps; None: measured as the loop runs.
    # (0 drafts whenever an n-gram matches: tests use it, the outputs do not depend on it.)
    cost_ratio: float | None = None


class NgramIndex:
    """Incremental n-gram index over one request's tokens (prompt, then outputs)."""

    __slots__ = ("tokens", "n_min", "n_max", "_next")

    def __init__(self, tokens: list[int], n_min: int, n_max: int) -> None:
        self.tokens: list[int] = []
        self.n_min, self.n_max = n_min, n_max
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for t in new:
            end = len(toks)  # t lands here: every n-gram ending just before it is followed by it
            for n in range(self.n_min, self.n_max + 1):
                if end >= n:
                    self._next[tuple(toks[end - n : end])] = end
            toks.append(t)

    def draft(self, k: int, lag: int = 0) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
        ending the sequence ([] when none occurred before). With lag 1 the sequence's next token
        is not known yet (it is being computed): the n-gram ends at the last known token, the
        token that followed it is taken as the unknown one's guess, and the drafts are the
        tokens after that guess (verification does not depend on the guess being right)."""
        toks = self.tokens
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            start = self._next.get(tuple(toks[len(toks) - n :]))
            if start is not None:
                return toks[start + lag : start + lag + k]
        return []


@dataclass
class SpecState:
    """One request's drafting state."""

    index: NgramIndex | None  # None: the draft model drafts
    k: int  # drafts to ask for next
    pause: int = 0  # decode steps left without drafting
    misses: int = 0  # times in a row drafting did not pay (its pause doubles)
    hits: float = 2.0  # decayed counts of accepted drafts and of the first rejected one (an
    stops: float = 1.0  # optimistic start): the per-draft acceptance rate is hits / (hits + stops)
    steps: int = 0  # verification steps
    accepted: int = 0  # drafts accepted in them
    synced: int = 0  # outputs already in the index

    @property
    def rate(self) -> float:
        return self.hits / (self.hits + self.stops)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verification of k drafts emits on average when each is accepted with `rate`
    (given the ones before it were): 1 + rate + ... + rate**k."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass
class SpecStats:
    """Accepted drafts per verification step, over all requests: a histogram over 0..K."""

    num_draft_tokens: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    hist: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hist = [0] * (self.num_draft_tokens + 1)

    def as_fields(self) -> dict:
        """As `SchedulerStats` fields."""
        return {"spec_verify_steps": self.steps, "spec_draft_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted, "spec_accept_hist": list(self.hist)}

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.hist[accepted] += 1


class Speculator:
    """Drafting policy. A verification step costs more than a plain decode step (more rows, and
    the next step waits for its result); the ratio is measured as the loop runs (`observe`). A
    request drafts when its expected tokens per verification (from its decayed acceptance
    counts) beat that ratio, and the batch verifies when its rows together do; a request for
    which it does not pay pauses 1, 2, 4, ... 16 steps before it looks again."""

    INITIAL_COST_RATIO = 2.0
    EMA = 0.1  # weight of a new iteration time
    DECAY = 0.9  # of a request's acceptance counts per verification

    def __init__(self, config: SpecConfig) -> None:
        self.config = config
        self.stats = SpecStats(config.num_draft_tokens)
        self._seconds: dict[bool, float | None] = {False: None, True: None}  # EMA per (verified?) iteration

    def active(self, num_decoding: int) -> bool:
        return num_decoding <= self.config.disable_batch_size

    @property
    def cost_ratio(self) -> float:
        """Seconds of a verification step over a plain decode step (measured, or configured)."""
        if self.config.cost_ratio is not None:
            return self.config.cost_ratio
        plain, spec = self._seconds[False], self._seconds[True]
        if plain is None or spec is None or plain <= 0:
            return self.INITIAL_COST_RATIO
        return spec / plain

    def observe(self, verified: bool, seconds: float) -> None:
        """A decode iteration's wall time: one that waited on a verification step's result, or
        an overlapped plain one."""
        old = self._seconds[verified]
        self._seconds[verified] = seconds if old is None else (1 - self.EMA) * old + self.EMA * seconds

    def eligible(self, req) -> bool:
        """Penalties and logit bias would depend on the drafts before a position: no drafts.
        Constrained requests draft n-grams, their masks following the drafts
        (GrammarQueue.masks); a draft model's drafts are not known on the host when the masks
        are filled, so constrained requests do not use it."""
        if req.grammar is not None or req.params.logit_changes != LogitChanges.NONE:
            return False
        return not (self.config.draft_model and req.matcher is not None)

    def _state(self, req) -> SpecState:
        st = req.spec
        if st is None:
            cfg = self.config
            index = None if cfg.draft_model else NgramIndex(req.prompt_ids, cfg.ngram_min, cfg.ngram_max)
            st = req.spec = SpecState(index, cfg.num_draft_tokens)
        return st

    def _candidate_k(self, req) -> int:
        """Drafts `req` would ask for now (0: it does not draft this step). Its decode step is
        planned already (num_outputs_launched counts it): the drafts and the token after them
        must fit max_new_tokens."""
        if not self.eligible(req):
            return 0
        st = self._state(req)
        return 0 if st.pause else min(st.k, req.max_new_tokens - req.num_outputs_launched)

    def _pays(self, expected: float, rows: int) -> bool:
        """A verification step costs `cost_ratio` plain steps for the whole batch; it pays when
        the batch's rows are expected to emit more tokens than that."""
        return rows > 0 and expected >= self.cost_ratio * rows

    def plan(self, reqs: list) -> list[list[int]]:
        """Each decode row's drafts for this step (all [] when drafting does not pay). A row's
        input is its newest output; when that is still being computed (the overlap loop), the
        drafts are looked up one token behind (`NgramIndex.draft` with lag 1). Paused requests
        count a step down; a request whose n-grams find nothing does not draft this step."""
        drafts: list[list[int]] = []
        expected = 0.0
        for req in reqs:
            k = self._candidate_k(req)
            st = req.spec
            if st is not None and st.pause:
                st.pause -= 1
            d = self._lookup(req, st, k) if k > 0 else []
            if d and expected_tokens(st.rate, len(d)) < self.cost_ratio:
                self._pause(st)  # not worth it for this request now: try again later
                d = []
            drafts.append(d)
            expected += expected_tokens(st.rate, len(d)) if d else 1.0
        if not self._pays(expected, len(reqs)):
            return [[] for _ in reqs]
        return drafts

    @staticmethod
    def _lookup(req, st: SpecState, k: int) -> list[int]:
        """Up to k drafts: placeholders the draft model fills on the device, or n-gram ones."""
        if st.index is None:
            return [DRAFT_ON_DEVICE] * k
        if st.synced < len(req.output_ids):
            st.index.extend(req.output_ids[st.synced :])
            st.synced = len(req.output_ids)
        # Outputs launched but not processed yet: at most the one being computed.
        return st.index.draft(k, lag=req.num_outputs_launched - 1 - len(req.output_ids))

    def verified(self, req, drafted: int, accepted: int) -> None:
        """Adapt `req`'s acceptance rate, draft length and pause to a verification's outcome."""
        st = req.spec
        self.stats.record(drafted, accepted)
        st.steps += 1
        st.accepted += accepted
        st.hits = self.DECAY * st.hits + accepted
        st.stops = self.DECAY * st.stops + (accepted < drafted)
        st.k = min(self.config.num_draft_tokens, drafted + 1) if accepted == drafted else max(1, accepted + 1)
        if accepted:
            st.misses = 0

    @staticmethod
    def _pause(st: SpecState) -> None:
        st.misses += 1
        st.pause = min(MAX_PAUSE_STEPS, 2 ** (st.misses - 1))
