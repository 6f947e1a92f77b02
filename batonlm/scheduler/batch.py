"""ScheduleBatch: the requests of one iteration and the launch that runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

from batonlm.ipc.device_messages import BatchLaunch
from batonlm.scheduler.request import Request


@dataclass
class ScheduleBatch:
    """`extend` rows compute new prompt tokens on top of their cached prefix (today: a whole
    prompt, prefix 0); `decode` rows feed their newest output token."""

    batch_id: int
    extend: list[Request] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    # Set when sampling must wait for state the previous result updates (grammar masks).
    delay_sampling: bool = False
    # Hooks (see docs/architecture.md, "Hooks"): speculative decoding and grammars change the
    # overlap policy; under data parallelism the ranks agree on one is_extend flag.
    is_speculative: bool = False
    has_grammar: bool = False
    global_is_extend: bool | None = None

    @property
    def reqs(self) -> list[Request]:
        """Rows in launch order: extend rows, then decode rows."""
        return self.extend + self.decode

    @property
    def is_extend(self) -> bool:
        return bool(self.extend)

    def __len__(self) -> int:
        return len(self.extend) + len(self.decode)

    def to_launch(self) -> BatchLaunch:
        """The device's view of this batch, once the scheduler has counted its rows as launched."""
        req_slots: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        input_ids: list[int] = []
        out_cache_loc: list[int] = []
        for r in self.extend:
            req_slots.append(r.req_slot)  # type: ignore[arg-type]
            prefix_lens.append(0)
            extend_lens.append(r.prompt_len)
            input_ids.extend(r.prompt_ids)
            out_cache_loc.extend(r.kv_slots[: r.prompt_len])
        for r in self.decode:
            req_slots.append(r.req_slot)  # type: ignore[arg-type]
            prefix_lens.append(r.kv_len - 1)
            extend_lens.append(1)
            out_cache_loc.append(r.kv_slots[r.kv_len - 1])
        reqs = self.reqs
        return BatchLaunch(
            batch_id=self.batch_id,
            req_slots=req_slots,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            from_future=[False] * len(self.extend) + [True] * len(self.decode),
            input_ids=input_ids,
            out_cache_loc=out_cache_loc,
            new_slots=[r.slot_sampling() for r in self.extend],
            all_greedy=all(r.params.is_greedy for r in reqs),
            any_penalties=any(r.params.has_penalties for r in reqs),
            sample=not self.delay_sampling,
            top_logprobs=max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=-1),
        )
