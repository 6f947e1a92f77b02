"""ScheduleBatch: the requests of one iteration and the launch that runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

from batonlm.ipc.device_messages import BatchLaunch, SlotInit
from batonlm.model_runner.forward_batch import ForwardMode
from batonlm.scheduler.request import Request


@dataclass
class ScheduleBatch:
    """`prefill` rows compute their whole prompt; `decode` rows feed their newest output."""

    batch_id: int
    prefill: list[Request] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    # Set when sampling must wait for state the previous result updates (grammar masks).
    delay_sampling: bool = False
    # Hooks for features that change the overlap policy (speculative decoding, grammars) and
    # for data parallelism, where ranks agree on one is_extend flag per iteration.
    is_speculative: bool = False
    has_grammar: bool = False
    global_is_extend: bool | None = None

    @property
    def mode(self) -> ForwardMode:
        if self.prefill and self.decode:
            return ForwardMode.MIXED
        if self.prefill:
            return ForwardMode.PREFILL
        return ForwardMode.DECODE if self.decode else ForwardMode.IDLE

    @property
    def reqs(self) -> list[Request]:
        """Rows in launch order: prefill rows, then decode rows."""
        return self.prefill + self.decode

    @property
    def is_extend(self) -> bool:
        return bool(self.prefill)

    def __len__(self) -> int:
        return len(self.prefill) + len(self.decode)

    def to_launch(self) -> BatchLaunch:
        """The device's view of this batch, once the scheduler has counted its rows as launched."""
        req_slots: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        input_ids: list[int] = []
        out_cache_loc: list[int] = []
        new_slots: list[SlotInit] = []
        all_greedy = True
        top_logprobs = -1
        for r in self.reqs:
            if r.params.logprobs is not None:
                top_logprobs = max(top_logprobs, r.params.logprobs)
        for r in self.prefill:
            req_slots.append(r.req_slot)  # type: ignore[arg-type]
            prefix_lens.append(0)
            extend_lens.append(r.prompt_len)
            input_ids.extend(r.prompt_ids)
            out_cache_loc.extend(r.kv_slots[: r.prompt_len])
            p = r.params
            greedy = p.is_greedy
            all_greedy &= greedy
            new_slots.append(
                SlotInit(
                    req_slot=r.req_slot,  # type: ignore[arg-type]
                    prompt_len=r.prompt_len,
                    temperature=0.0 if greedy else p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    min_p=p.min_p,
                    seed=r.seed,
                    min_new_tokens=p.min_new_tokens,
                    stop_ids=sorted(r.stop_ids) if p.min_new_tokens > 0 else [],
                    frequency_penalty=p.frequency_penalty,
                    presence_penalty=p.presence_penalty,
                    repetition_penalty=p.repetition_penalty,
                    logit_bias=p.logit_bias,
                )
            )
        for r in self.decode:
            req_slots.append(r.req_slot)  # type: ignore[arg-type]
            prefix_lens.append(r.kv_len - 1)
            extend_lens.append(1)
            out_cache_loc.append(r.kv_slots[r.kv_len - 1])
            all_greedy &= r.params.is_greedy
        return BatchLaunch(
            batch_id=self.batch_id,
            mode=int(self.mode),
            req_slots=req_slots,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            from_future=[False] * len(self.prefill) + [True] * len(self.decode),
            input_ids=input_ids,
            out_cache_loc=out_cache_loc,
            new_slots=new_slots,
            all_greedy=all_greedy,
            sample=not self.delay_sampling,
            top_logprobs=top_logprobs,
        )
