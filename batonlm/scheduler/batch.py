"""ScheduleBatch: the requests of one iteration and the launch that runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

from batonlm.ipc.device_messages import BatchLaunch
from batonlm.sampling_params import LogitChanges
from batonlm.scheduler.request import Request


@dataclass
class ExtendRow:
    """`extend_len` new tokens of `req` at positions prefix_len.., on top of its KV for
    positions 0..prefix_len-1 (its cached prefix, or its earlier chunks)."""

    req: Request
    prefix_len: int
    extend_len: int
    first: bool  # the request's first launch since its admission

    @property
    def produces_output(self) -> bool:
        """The chunk that completes the prefill: its last logits give the next output."""
        return self.prefix_len + self.extend_len == self.req.fill_len


@dataclass
class ScheduleBatch:
    """`extend` rows compute new tokens on top of a cached prefix (a prompt, a chunk of one, or
    a retracted request's prompt and outputs); `decode` rows feed their newest output."""

    batch_id: int
    extend: list[ExtendRow] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    # Each row's request epoch at launch: a retraction in between voids the row's result.
    epochs: list[int] = field(default_factory=list)
    # Set when sampling must wait for state the previous result updates (grammar masks).
    delay_sampling: bool = False
    # Hooks (see docs/architecture.md, "Hooks"): speculative decoding and grammars change the
    # overlap policy; under data parallelism the ranks agree on one is_extend flag.
    is_speculative: bool = False
    has_grammar: bool = False
    global_is_extend: bool | None = None
    launch: BatchLaunch | None = None  # built when the batch is planned
    # Per extend row: how many prompt logprobs its launch computes (to split the result).
    prompt_logprob_counts: list[int] = field(default_factory=list)
    # Per extend row: whether its launch pools hidden states for its embedding (one span each).
    pooled_rows: list[bool] = field(default_factory=list)
    # Per decode row: the draft tokens it verifies (speculative decoding; [] for a plain decode).
    drafts: list[list[int]] = field(default_factory=list)
    # The launch row of each row (a verifying request has 1 + k launch rows; set by to_launch).
    launch_rows: list[int] = field(default_factory=list)

    @property
    def reqs(self) -> list[Request]:
        """Rows in launch order: extend rows, then decode rows."""
        return [row.req for row in self.extend] + self.decode

    @property
    def produces_output(self) -> list[bool]:
        return [row.produces_output for row in self.extend] + [True] * len(self.decode)

    @property
    def is_extend(self) -> bool:
        return bool(self.extend)

    def __len__(self) -> int:
        return len(self.extend) + len(self.decode)

    def to_launch(self) -> BatchLaunch:
        """The device's view of this batch, once the planner has allocated its slots."""
        req_slots: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        input_ids: list[int] = []
        out_cache_loc: list[int] = []
        table_writes: list[tuple[int, list[int]]] = []
        lp_at: list[int] = []  # flat token index of each position whose logits score a prompt token
        lp_targets: list[int] = []
        pool_spans: list[tuple[int, int]] = []
        lora_slots: list[int] = []  # each launch row's adapter (a verifying request's rows all its own)
        long_rope: list[bool] = []  # each launch row's rotation regime (LongRoPE)
        self.prompt_logprob_counts = []
        self.pooled_rows = []
        for row in self.extend:
            r, start, end = row.req, row.prefix_len, row.prefix_len + row.extend_len
            assert r.req_slot is not None  # admitted: KVMemory.match gave it one
            targets: list[int] = []
            if r.wants_prompt_logprobs:
                first, targets = r.prompt_logprob_targets(start, end)
                offset = len(input_ids) + first - start
                lp_at.extend(range(offset, offset + len(targets)))
                lp_targets.extend(targets)
            self.prompt_logprob_counts.append(len(targets))
            span = r.pool_span(start, end) if r.pooling is not None else None
            if span is not None:
                pool_spans.append((len(input_ids) + span[0], span[1]))
            self.pooled_rows.append(span is not None)
            req_slots.append(r.req_slot)
            lora_slots.append(r.lora)
            long_rope.append(r.long_rope)
            prefix_lens.append(start)
            extend_lens.append(row.extend_len)
            input_ids.extend(r.fill_ids[start:end])
            out_cache_loc.extend(r.kv_slots[start:end])
            if row.first and start:  # a cached prefix: the device's row must point at it
                table_writes.append((r.req_slot, r.kv_slots[:start]))
        # A verifying request (drafts) runs as 1 + k decode rows, one per position: its newest
        # output (from the FutureMap while it is being computed), then its drafts. Each row samples the token
        # after its position, as a plain decode step there would (spec_verify.py).
        verify_groups: list[tuple[int, int]] = []
        from_future = [False] * len(self.extend)
        self.launch_rows = list(range(len(self.extend)))
        for i, r in enumerate(self.decode):
            assert r.req_slot is not None  # running: it holds one
            drafts = self.drafts[i] if self.drafts else []
            n = 1 + len(drafts)
            p = r.kv_len - n
            self.launch_rows.append(len(req_slots))
            # Its input at p: known (its result was processed) or still being computed (in flight).
            known = p - r.prompt_len < len(r.output_ids)
            if drafts:
                verify_groups.append((len(req_slots), n))
                input_ids.extend([r.output_ids[p - r.prompt_len]] if known else [])
                input_ids.extend(drafts)
            req_slots.extend([r.req_slot] * n)
            lora_slots.extend([r.lora] * n)
            long_rope.extend([r.long_rope] * n)
            prefix_lens.extend(range(p, p + n))
            extend_lens.extend([1] * n)
            out_cache_loc.extend(r.kv_slots[p : p + n])
            from_future.extend([not (drafts and known)] + [False] * (n - 1))
        reqs = self.reqs
        produces = self.produces_output
        return BatchLaunch(
            batch_id=self.batch_id,
            req_slots=req_slots,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            from_future=from_future,
            input_ids=input_ids,
            out_cache_loc=out_cache_loc,
            new_slots=[row.req.slot_sampling() for row in self.extend if row.first],
            all_greedy=all(r.params.is_greedy for r in reqs),
            logit_changes=max((r.params.logit_changes for r in reqs), default=LogitChanges.NONE),
            sample=not self.delay_sampling,
            top_logprobs=max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=-1),
            table_writes=table_writes,
            output_rows=[self.launch_rows[i] for i, p in enumerate(produces) if p] if not all(produces) else None,
            prompt_logprob_at=lp_at,
            prompt_logprob_targets=lp_targets,
            verify_groups=verify_groups,
            pool_spans=pool_spans,
            lora_slots=lora_slots if any(lora_slots) else [],
            long_rope=long_rope if any(long_rope) else [],
            prompt_top_logprobs=max(
                (k for row, n in zip(self.extend, self.prompt_logprob_counts)
                 if n and (k := row.req.params.prompt_logprobs) is not None),
                default=-1,
            ),
        )
