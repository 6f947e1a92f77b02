"""The device side of one iteration: resolve inputs, forward, sample, stash into the FutureMap.

Runs wherever the device is: in the CPU device worker process, or in the scheduler process
on a CUDA stream. It never touches scheduler bookkeeping; a `BatchLaunch` carries all it needs.
"""

from __future__ import annotations

import torch

from batonlm.device.future_map import FutureMap
from batonlm.ipc.device_messages import BatchLaunch, IdleLaunch, SampleLaunch
from batonlm.kernels.token_bitmask import apply_token_bitmask_packed, apply_token_bitmask_triton
from batonlm.model_runner import spec_verify
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.host_to_device import to_device
from batonlm.model_runner.model_runner import ModelRunner
from batonlm.model_runner.sampler import SampleOutput

# Prompt logprobs of a launch: (logprob [N], top ids [N, m], top logprobs [N, m]).
Scored = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Kept:
    """What a launch takes from hidden states besides its logits: prompt logprobs, and the
    sums embeddings pool."""

    __slots__ = ("prompt", "pooled")

    def __init__(self, prompt: Scored | None = None, pooled: torch.Tensor | None = None) -> None:
        self.prompt, self.pooled = prompt, pooled


def resolve_input_ids(launch: BatchLaunch, batch: ForwardBatch, future_map: FutureMap) -> torch.Tensor:
    """A launch's input ids: decode rows' from the FutureMap (stashed by the batch before),
    the others' from the launch. Token offsets are computed on the host: nothing waits."""
    device = batch.positions.device
    future_rows = [i for i, f in enumerate(launch.from_future) if f]
    if not future_rows:
        return to_device(launch.input_ids, torch.int64, device)
    if len(future_rows) == len(launch.from_future):
        return future_map.resolve_forward_inputs(batch.req_slots, batch.positions)
    future_at: list[int] = []  # a mixed batch
    host_at: list[int] = []
    offset = 0
    for n, fut in zip(launch.extend_lens, launch.from_future):
        (future_at if fut else host_at).extend(range(offset, offset + n))
        offset += n
    rows, starts = (to_device(x, torch.int64, device) for x in (future_rows, future_at))
    ids = torch.empty(batch.num_tokens, dtype=torch.int64, device=device)
    ids[starts] = future_map.resolve_forward_inputs(batch.req_slots[rows], batch.positions[starts])
    ids[to_device(host_at, torch.int64, device)] = to_device(launch.input_ids, torch.int64, device)
    return ids


def relay_outputs(future_map: FutureMap, batch: ForwardBatch, launch: BatchLaunch, token_ids: torch.Tensor,
                  verified: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Stash each row's sampled token for the next launch; a verifying request's next input is
    the token after its accepted drafts (`verified`: accepted [G], that token [G])."""
    future_map.stash(batch.req_slots, token_ids)
    future_map.publish(batch.req_slots, batch.seq_lens)
    if verified is not None:
        accepted, bonus = verified
        firsts = to_device([f for f, _ in launch.verify_groups], torch.int64, batch.positions.device)
        future_map.stash(batch.req_slots[firsts], bonus)
        future_map.publish(batch.req_slots[firsts], batch.seq_lens[firsts] + accepted)


class BatchExecutor:
    def __init__(self, runner: ModelRunner, future_map: FutureMap, draft: ModelRunner | None = None) -> None:
        self.runner = runner
        self.future_map = future_map
        # Speculative decoding's draft model: its KV pool mirrors the target's slots, kept in sync
        # by running every batch through it too; it writes the drafts of verify groups.
        self.draft = draft
        self.device = runner.device
        # batch_id -> (logits, batch, launch, what it kept, draft q) of launches whose sampling was delayed.
        self._unsampled: dict[
            int, tuple[torch.Tensor, ForwardBatch, BatchLaunch, Kept, torch.Tensor | None]
        ] = {}

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def run(self, launch: BatchLaunch) -> SampleOutput | None:
        """Execute one launch; returns the sampled ids, or None when sampling is delayed."""
        for rec in launch.new_slots:
            self.runner.sampling_table.init_slot(rec)
        for req_slot, slots in launch.table_writes:
            for r in (self.runner, self.draft) if self.draft is not None else (self.runner,):
                r.req_to_token.write_prefix(req_slot, self._tensor(slots))
        batch = ForwardBatch.build(
            self._tensor(launch.out_cache_loc),
            launch.req_slots,
            launch.prefix_lens,
            launch.extend_lens,
            self.device,
            rope_offsets=[self.runner.long_rope_offset if long else 0 for long in launch.long_rope] or None,
        )
        batch.input_ids = resolve_input_ids(launch, batch, self.future_map)  # decode inputs depend on positions
        batch.dp_tokens = launch.dp_tokens
        if launch.lora_slots and self.runner.lora is not None:
            batch.lora = self.runner.lora.batch(launch.lora_slots, launch.extend_lens, self.device)
        draft_q = self._draft(launch, batch) if self.draft is not None and launch.verify_groups else None
        kept = Kept()
        if launch.prompt_logprob_at or launch.pool_spans:
            logits, hidden = self.runner.forward_hidden(batch)
            if launch.prompt_logprob_at:
                kept.prompt = self.runner.score_prompt(hidden[self._tensor(launch.prompt_logprob_at)],
                                                       self._tensor(launch.prompt_logprob_targets),
                                                       launch.prompt_top_logprobs)
            if launch.pool_spans:
                kept.pooled = self.runner.pool(hidden, launch.pool_spans)
        else:
            logits = self.runner.forward(batch)
        if self.draft is not None:
            self.draft.forward(batch)  # the draft's KV follows every position the target computes
        if not launch.sample:
            self._unsampled[launch.batch_id] = (logits, batch, launch, kept, draft_q)
            return None
        return self._sample_and_stash(logits, batch, launch, kept, draft_q)

    def run_idle(self, idle: IdleLaunch) -> None:
        """DP attention: no batch of ours; our part of the other ranks' MLPs."""
        self.runner.idle_forward(idle.dp_tokens)

    def _draft(self, launch: BatchLaunch, batch: ForwardBatch) -> torch.Tensor:
        """Each verify group's drafts, one draft-model decode step per draft position (the
        row at p + s feeds the token it has and samples the one after, into the next row's
        input). Returns q [rows, V]: at each draft's row, the distribution it was drawn from."""
        draft, input_ids = self.draft, batch.input_ids
        assert draft is not None and input_ids is not None  # run() drafts only with a draft model, after the inputs
        groups = launch.verify_groups
        q_all = torch.zeros(batch.batch_size, draft.cfg.vocab_size, device=self.device)
        table = self.runner.sampling_table
        for s in range(max(n for _, n in groups) - 1):
            rows = [f + s for f, n in groups if n - 1 > s]
            at = self._tensor(rows)
            flat = batch.last_token_index[at]  # a verify row's one token (rows after an extend row shift)
            step = ForwardBatch.build(batch.out_cache_loc[flat], [launch.req_slots[r] for r in rows],
                                      [launch.prefix_lens[r] for r in rows], [1] * len(rows), self.device,
                                      input_ids=input_ids[flat])
            logits = draft.forward(step)
            draw = table.gather(step.req_slots, step.seq_lens, launch.all_greedy).draw
            q = spec_verify.request_probs(logits, draw)
            keys = spec_verify.salted(draw.keys, spec_verify.DRAFT_SALT) if draw is not None else \
                torch.zeros(len(rows), dtype=torch.int64, device=self.device)
            input_ids[flat + 1] = spec_verify.race(q, keys)
            q_all[at + 1] = q
        return q_all

    @torch.inference_mode()  # the logits are inference tensors: masked in place, not copied
    def sample_delayed(self, sample: SampleLaunch) -> SampleOutput:
        logits, batch, launch, kept, draft_q = self._unsampled.pop(sample.batch_id)
        # The logits are this launch's own (popped): masks go on in place.
        for row, ids in sample.banned.items():
            logits[row, self._tensor(ids)] = float("-inf")
        if sample.mask_rows and logits.is_cuda:
            words = torch.frombuffer(bytearray(sample.bitmask), dtype=torch.int32)
            bitmask = words.view(len(sample.mask_rows), sample.mask_words).to(self.device, non_blocking=True)
            apply_token_bitmask_triton(logits, bitmask, self._tensor(sample.mask_rows))
        elif sample.mask_rows:
            apply_token_bitmask_packed(logits, sample.bitmask, sample.mask_words, sample.mask_rows)
        return self._sample_and_stash(logits, batch, launch, kept, draft_q)

    def _sample_and_stash(
        self, logits: torch.Tensor, batch: ForwardBatch, launch: BatchLaunch, kept: Kept,
        draft_q: torch.Tensor | None = None,
    ) -> SampleOutput:
        rows = None if launch.output_rows is None else self._tensor(launch.output_rows)
        out = self.runner.sample(
            logits, batch, all_greedy=launch.all_greedy, logit_changes=launch.logit_changes,
            top_logprobs=launch.top_logprobs, output_rows=rows,
        )
        verified = None
        if launch.verify_groups:  # each verifying request's next input: the token after its accepted drafts
            assert batch.input_ids is not None  # set by run() before the forward
            if draft_q is None:  # each verify row's input: its one token (rows, not tokens, index groups)
                verified = spec_verify.accept_drafts(out.token_ids, batch.input_ids[batch.last_token_index],
                                                     launch.verify_groups)
            else:
                verified = self._reject(logits, batch, launch, out, draft_q)
            out.accepted = verified[0]
        relay_outputs(self.future_map, batch, launch, out.token_ids, verified)
        if kept.prompt is not None:
            out.prompt_logprobs, out.prompt_top_ids, out.prompt_top_logprobs = kept.prompt
        out.pooled = kept.pooled
        return out

    @torch.inference_mode()
    def _reject(self, logits: torch.Tensor, batch: ForwardBatch, launch: BatchLaunch, out: SampleOutput,
                draft_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling of the draft model's drafts; each group's rows then hold the tokens
        it emits (accepted drafts, then the token after them), their logprobs recomputed."""
        table = self.runner.sampling_table
        draw = table.gather(batch.req_slots, batch.seq_lens, launch.all_greedy).draw
        p_all = spec_verify.request_probs(logits, draw)
        keys = draw.keys if draw is not None else torch.zeros(batch.batch_size, dtype=torch.int64, device=self.device)
        tokens = out.token_ids.clone()
        assert batch.input_ids is not None  # set by run() before the forward
        inputs = batch.input_ids[batch.last_token_index]  # per row
        accepted, bonus = [], []
        for first, n in launch.verify_groups:
            rows = slice(first, first + n)
            a, token = spec_verify.rejection_verify(p_all[rows], draft_q[first + 1 : first + n],
                                                    inputs[first + 1 : first + n], keys[rows])
            tokens[first : first + a] = inputs[first + 1 : first + 1 + a]
            if token is not None:
                tokens[first + a] = token
            accepted.append(a)
            bonus.append(int(tokens[first + a]))
        out.token_ids = tokens
        if out.logprobs is not None:  # of the tokens emitted
            temperature = draw.temperature if draw is not None else torch.zeros_like(logits[:, 0])
            out.logprobs, out.top_ids, out.top_logprobs = self.runner.sampler.logprobs(
                logits, temperature, tokens, launch.top_logprobs)
        return self._tensor(accepted), self._tensor(bonus)
