"""What the graph-backed decode steps share: the interface, and batch-size buckets.

A decode step is the same few hundred ops every iteration; only the batch size and the context
lengths change. `CudaGraphDecode` (CUDA graphs) runs an all-decode batch of n rows as a graph
captured for the smallest bucket >= n. Padding rows are harmless: they write their K/V to the
pool's padding slot 0, attend to one key, and their logits are dropped. `CompiledDecode` (CPU,
torch.compile) compiles the batch size symbolic over a few ranges instead and pads nothing.
Prefills and chunks stay eager: their shapes vary too much to pay.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from batonlm.model_runner.forward_batch import ForwardBatch

Progress = Callable[[str], None]

# CompiledDecode's largest batch; larger ones run eagerly (a batch that large amortises its
# dispatch over its rows). Here, not in compiled_decode.py: the scheduler reads it, and
# importing torch._dynamo there would delay the device worker's start by a second.
COMPILE_MAX_BS = 64


def batch_buckets(max_bs: int, step: int | None = None) -> tuple[int, ...]:
    """Powers of two up to `max_bs`; with `step`, powers of two up to it and then every `step`
    rows (SGLang's spacing for CUDA graphs, where a graph costs little to capture). The last
    bucket is `max_bs`."""
    out, b = [], 1
    while b < max_bs and (step is None or b < step):
        out.append(b)
        b *= 2
    if step is not None:
        out += range(step, max_bs, step)
    out.append(max_bs)
    return tuple(sorted(set(out)))


def smallest_bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class DecodeGraphs(ABC):
    """Runs all-decode batches of up to `max_bs` rows through prepared graphs."""

    max_bs: int
    max_context: int

    def fits(self, batch: ForwardBatch) -> bool:
        return (
            batch.max_extend_len == 1
            and 0 < batch.batch_size <= self.max_bs
            and batch.max_seq_len <= self.max_context
        )

    @abstractmethod
    def describe(self) -> str:
        """The batch sizes the graphs were built for, for the start-up log."""

    @abstractmethod
    def prepare(self, progress: Progress) -> float:
        """Build every graph once, before the first request (no request waits for it); returns
        the seconds it took."""

    @abstractmethod
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [B, V] of an all-decode batch that `fits`."""
