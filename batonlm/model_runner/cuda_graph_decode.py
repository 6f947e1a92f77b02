"""CUDA graphs of the decode step: captured at start-up for each batch-size bucket, replayed.

A decode step of a small model is launch-bound: hundreds of kernel launches of a few
microseconds each. Each bucket's forward (embedding, every layer with the backend's attention —
the Triton split-KV kernel by default — the final norm, the logits) is captured once, over
static input buffers; a step copies its inputs into them and replays the graph.

The FutureMap relay keeps working: the scheduler never sends the ids of decode rows, the
executor resolves them on the device from the relay's buffer, and `run` copies them into the
graph's input buffer with a device-to-device copy — nothing waits on the host. Sampling (the
Triton sampler) runs after the replay on a copy of the logits: the next replay overwrites the
graph's output buffer, and a delayed sample may come after it.

Every graph is captured for the largest context (`max_seq_len = context_length`): the decode
kernel's split count is fixed per graph, and each split reads its row's own length from the
device, so one graph serves any mix of lengths.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from batonlm.model_runner.decode_graphs import DecodeGraphs, Progress, batch_buckets, smallest_bucket
from batonlm.model_runner.forward_batch import ForwardBatch, RowGroup
from batonlm.model_runner.lora import RowSlotLoRA

if TYPE_CHECKING:
    from batonlm.model_runner.model_runner import ModelRunner

# Buckets: 1, 2, 4, then every 8 rows (a graph costs a few milliseconds to capture).
BUCKET_STEP = 8
WARMUP_RUNS = 2  # Triton compiles and the allocator settles before a capture


class CudaGraphDecode(DecodeGraphs):
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.batch_buckets = batch_buckets(max_bs, step=BUCKET_STEP)
        self.max_bs = n = self.batch_buckets[-1]
        self.max_context = runner.context_length

        def buffer(fill: int = 0) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int64, device=runner.device)

        # Static inputs every graph reads ([:b] views); padding rows keep the fill values.
        self.input_ids, self.positions, self.req_slots, self.prefix_lens = buffer(), buffer(), buffer(), buffer()
        self.out_cache_loc, self.seq_lens, self.ones = buffer(), buffer(1), buffer(1)
        self.lora_slots = buffer()  # LoRA: each row's adapter slot (a graph input; padding rows: the base model)
        self.arange = torch.arange(n, dtype=torch.int64, device=runner.device)
        # (bucket, with LoRA) -> its graph and output: with LoRA adapters each bucket has a second
        # graph, for batches with adapters (the rows' slots an input); the base model's run the first.
        self.variants = (False,) if runner.lora is None else (False, True)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}

    def describe(self) -> str:
        lora = ", with and without LoRA adapters" if len(self.variants) > 1 else ""
        return f"batch buckets {list(self.batch_buckets)}{lora}"

    def _batch(self, b: int, lora: bool = False) -> ForwardBatch:
        """The static ForwardBatch of bucket `b`: every row one decode token, its own last."""
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b], out_cache_loc=self.out_cache_loc[:b],
            req_slots=self.req_slots[:b], prefix_lens=self.prefix_lens[:b], extend_lens=self.ones[:b],
            seq_lens=self.seq_lens[:b], extend_starts=self.arange[:b], last_token_index=self.arange[:b],
            max_extend_len=1, max_seq_len=self.max_context, num_tokens=b,
            groups=[RowGroup(slice(0, b), slice(0, b), 1, self.max_context)],
            lora=RowSlotLoRA(self.runner.lora, self.lora_slots[:b]) if lora and self.runner.lora is not None else None,
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        r = self.runner
        r.attn.prepare(batch)
        return r.model.logits(r.model(batch.input_ids, batch, r.attn))

    @torch.inference_mode()
    def prepare(self, progress: Progress) -> float:
        start = time.perf_counter()
        pool = None
        progress(f"capturing CUDA graphs of the decode step for batch sizes {list(self.batch_buckets)}")
        # Largest first: the smaller graphs reuse its memory pool.
        for b in reversed(self.batch_buckets):
            for lora in self.variants:
                batch = self._batch(b, lora)
                for _ in range(WARMUP_RUNS):
                    self._forward(batch)
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b, lora] = self._forward(batch)
                pool = graph.pool()
                self.graphs[b, lora] = graph
        torch.cuda.synchronize(self.runner.device)
        return time.perf_counter() - start

    def stage(self, batch: ForwardBatch) -> int:
        """Copy a decode batch into the static inputs (device to device), pad the rest of its
        bucket, and return the bucket."""
        assert batch.input_ids is not None  # set before any forward
        n = batch.batch_size
        b = smallest_bucket(n, self.batch_buckets)
        positions = batch.positions if batch.rope_positions is None else batch.rope_positions  # the rotary's only
        for static, value in (
            (self.input_ids, batch.input_ids), (self.positions, positions), (self.req_slots, batch.req_slots),
            (self.prefix_lens, batch.prefix_lens), (self.seq_lens, batch.seq_lens),
            (self.out_cache_loc, batch.out_cache_loc),
        ):
            static[:n].copy_(value, non_blocking=True)
        if batch.lora is not None:  # the graph with LoRA reads them
            self.lora_slots[:n].copy_(torch.tensor(batch.lora.row_slots, dtype=torch.int64), non_blocking=True)
        if b > n:  # padding rows: slot 0, one key at position 0 (the KV pool's padding slot)
            for static in (self.input_ids, self.positions, self.req_slots, self.prefix_lens, self.out_cache_loc,
                           self.lora_slots):
                static[n:b].zero_()
            self.seq_lens[n:b].fill_(1)
        return b

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        b, lora = self.stage(batch), batch.lora is not None
        self.graphs[b, lora].replay()
        return self.logits[b, lora][: batch.batch_size].clone()
