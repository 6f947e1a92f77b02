"""`--debug-tp-check-every N`: do the tensor-parallel ranks still compute the same thing?

Every rank samples its own tokens from logits that should be identical on all of them (the
LM head gathers them), with the same seeded sampling; the next launch takes its input ids from
each rank's own FutureMap. A rank that drifted would silently feed itself other tokens. Every
N results each rank hashes (batch id, sequence lengths, sampled ids, accepted drafts), the ranks
all-gather the hashes, and any difference stops the group with an error naming the ranks.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from batonlm.distributed.group import TPGroup


class TPDivergenceError(RuntimeError):
    """Tensor-parallel ranks computed different results for the same launch."""


def digest(batch_id: int, seq_lens: list[int], token_ids: list[int], accepted: list[int] | None) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in (batch_id, seq_lens, token_ids, accepted or []):
        values = part if isinstance(part, list) else [part]
        h.update(struct.pack(f"<{len(values) + 1}q", len(values), *values))
    return struct.unpack("<q", h.digest())[0]


def check_agreement(tp: TPGroup, value: int, what: str) -> None:
    """All-gather `value` over the ranks; raise TPDivergenceError unless every rank has rank 0's."""
    values = [int(t) for t in tp.all_gather_cpu(torch.tensor([value], dtype=torch.int64))]
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise TPDivergenceError(f"tensor-parallel ranks {differ} differ from rank 0 at {what} "
                                f"(hashes {', '.join(f'{v & (2**64 - 1):016x}' for v in values)})")


class DivergenceCheck:
    def __init__(self, tp: TPGroup, every: int) -> None:
        self.tp = tp
        self.every = every
        self.results = 0
        self.checks = 0

    def after(self, batch_id: int, seq_lens: list[int], token_ids: list[int], accepted: list[int] | None) -> None:
        """Called by every rank after every result, in the same order."""
        if not self.every:
            return
        self.results += 1
        if self.results % self.every:
            return
        self.checks += 1
        check_agreement(self.tp, digest(batch_id, seq_lens, token_ids, accepted), f"batch {batch_id}")
