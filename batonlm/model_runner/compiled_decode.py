"""The compiled decode step (CPU): a few inductor graphs, each for a range of batch sizes.

A decode step over a small model is a few hundred tiny torch ops, and dispatching them costs
more than computing them (stories260K at batch 1: 0.92 ms eager, 0.39 ms compiled; the
table is in docs/benchmarks.md).
`torch.compile` turns the step — embedding, every layer, the final norm and the logits — into
generated C++: one graph for one row, one for 2 to 64 rows with the batch size symbolic
(BATCH_RANGES): two graphs serve every batch with no padding row, and the same two serve any
--max-running-requests. Each row's context is gathered over the batch's longest
context rounded up to CONTEXT_GRANULE keys, those past the row's length masked out; the context
dimension, and the KV pool's and req-to-token table's sizes, are symbolic too.

The attention inside the graph is the torch backend's decode math (gather through the
req-to-token row, SDPA with a length mask per layer over [B, kv_heads, L, d]); the rest is
the model's own code. Compiled artefacts go to the inductor cache in `cache_dir`: a restart
recompiles nothing (cold and cached start-up times: docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch._dynamo

from batonlm.kernels import cpu_attention, cpu_linear
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.decode_graphs import COMPILE_MAX_BS, DecodeGraphs, Progress
from batonlm.model_runner.direct_graph import DirectGraph, GraphCapture
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.lora import LoRAWeights, RowSlotLoRA
from batonlm.model_runner.models.base import CausalLM

# The context dimension is compiled dynamic: one graph serves every width, and the width is the
# batch's longest context rounded up to this (a power of two would double the attention work
# of a 129-token context).
CONTEXT_GRANULE = 32


# The batch sizes each graph serves: one row (dynamo specialises a size of 1; the projections are
# reductions, linear.py), and the rest (symbolic; oneDNN's packed GEMM). Fixed ranges: a server
# started with another --max-running-requests traces the same graphs and finds them in the
# inductor cache.
BATCH_RANGES = ((1, 1), (2, COMPILE_MAX_BS))


def probe_vector_isa_early() -> None:
    """Start inductor's check of the vector instruction sets in a thread. It builds and loads a
    probe library per instruction set in child processes (~0.8 s at every start, cached
    artefacts or not, measured with benchmarks/startup.py); begun before the model loads, it runs
    while the first graph is traced and is done when inductor asks for its answer."""
    import threading

    from torch._inductor import cpu_vec_isa

    def probe() -> None:
        # A compiler that fails here fails the compile too, which reports it in one line.
        with contextlib.suppress(Exception):
            cpu_vec_isa.pick_vec_isa()

    threading.Thread(target=probe, name="vector-isa-probe", daemon=True).start()


def batch_ranges(max_bs: int) -> tuple[tuple[int, int], ...]:
    """The BATCH_RANGES that batches of up to `max_bs` rows reach."""
    return tuple((lo, hi) for lo, hi in BATCH_RANGES if lo <= max_bs)


class CompileFailed(RuntimeError):
    """torch.compile could not build the decode step (the caller stays eager)."""


def context_width(max_seq_len: int, max_context: int) -> int:
    """The keys a step gathers per row: its longest context rounded up to CONTEXT_GRANULE."""
    return min(-(-max_seq_len // CONTEXT_GRANULE) * CONTEXT_GRANULE, max_context)


@contextlib.contextmanager
def _quiet_torch_logs():
    """A failed compile is reported in one line by the caller; torch would log its traceback."""
    loggers = [logging.getLogger(name) for name in ("torch._dynamo", "torch._inductor", "torch._guards", "torch.fx")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _DecodeInputs(NamedTuple):
    """What the model and the attention read of a padded decode batch (the `batch` they get)."""

    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    attn_metadata: tuple[torch.Tensor, dict[int | None, torch.Tensor]]
    lora: RowSlotLoRA | None = None  # LoRA: every row's adapter delta, fixed shapes (lora.py)
    dp_tokens: None = None  # never DP attention (its MLP gathers every rank's tokens: eager)


class PaddedDecodeAttention(AttentionBackend):
    """Decode attention over a [B, L] window of every row's KV slots with a length mask: every
    shape depends only on the buckets, so the whole step traces into one graph. `in_place`: the
    CPU kernel reads the keys where they are (kernels/cpu_attention.py), else they are gathered."""

    in_place = False

    def metadata(self, req_slots: torch.Tensor, seq_lens: torch.Tensor, key_pos: torch.Tensor):
        valid = key_pos[None, :] < seq_lens[:, None]  # [B, L]
        # Indexed, not sliced: a slice ending at the table's width would pin the dynamic length.
        kv_index = torch.where(valid, self.req_to_token.table[req_slots[:, None], key_pos[None, :]], 0).reshape(-1)
        query_pos = (seq_lens - 1)[:, None]
        masks = {}  # window -> [B, L]: which keys each row attends to
        for window in set(self.sliding_windows):
            masks[window] = valid if window is None else valid & (key_pos[None, :] > query_pos - window)
        return kv_index, masks

    def prepare(self, batch: ForwardBatch) -> None:
        raise TypeError("PaddedDecodeAttention builds its metadata inside the compiled step")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch) -> torch.Tensor:
        self.kv_pool.write(layer, batch.out_cache_loc, k, v)
        kv_index, masks = batch.attn_metadata
        kvh, d = self.num_kv_heads, self.head_dim
        b = q.shape[0]
        s = kv_index.shape[0] // b
        mask = masks[self.sliding_windows[layer]]  # [B, L]
        if self.in_place:  # each key read where it is (kernels/cpu_attention.py)
            out = torch.ops.batonlm.paged_decode_attention(q.view(b, kvh, -1, d), self.kv_pool.k[layer],
                                                           self.kv_pool.v[layer], kv_index.view(b, s), mask, self.scale)
            return out.reshape(b, self.num_heads * d)
        keys, values = self.kv_pool.gather(layer, kv_index)  # dequantized from an FP8 pool, scales baked in
        # [B, kv_heads, L, d] keys and values against [B, kv_heads, group, d] queries: the group's
        # query heads are SDPA's query rows, so grouped-query attention needs no repeated keys.
        keys, values = keys.view(kvh, b, s, d).transpose(0, 1), values.view(kvh, b, s, d).transpose(0, 1)
        queries = q.view(b, kvh, -1, d)
        # SDPA, an extern kernel: its inputs are materialised, so the gathered keys are read
        # contiguously (fused into the score loops, inductor re-derived every key's slot per
        # element: 137 us a layer at 128 keys on the 25M shape), and the projections around it
        # stay separate loops (benchmarks/decode_step.py: 5.8 -> 3.8 ms a step there; stories260K
        # within noise).
        out = self.masked_attention(queries, keys, values, mask[:, None, None, :])  # mask: [B, 1, 1, L]
        return out.reshape(b, self.num_heads * d)


class CompiledDecode(DecodeGraphs):
    def __init__(
        self, model: CausalLM, attn: AttentionBackend, *, max_bs: int, max_context: int, cache_dir: str,
        lora: LoRAWeights | None = None,
    ) -> None:
        """`attn`: the runner's attention backend, whose KV pool, req-to-token table and geometry
        (heads, head dim, windows, scale, soft-capping) the step's attention shares. `lora`: the
        runner's LoRA slots: each range then has a second graph, for batches with adapters, that
        adds each row's adapter delta (RowSlotLoRA); batches of the base model alone run the
        first, which has no LoRA."""
        if not 1 <= max_bs <= COMPILE_MAX_BS:
            raise ValueError(f"the compiled decode step serves 1 to {COMPILE_MAX_BS} rows, not {max_bs}")
        self.model = model
        self.lora = lora
        kv_pool, req_to_token = attn.kv_pool, attn.req_to_token
        self.attn = PaddedDecodeAttention(kv_pool, req_to_token, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                          attn.sliding_windows, attn.scale, attn.softcap)
        self.attn.in_place = cpu_attention.supports(kv_pool, attn.softcap)
        cpu_linear.available()  # built (or not) before a graph is traced: linear.py reads the answer
        self.max_bs = max_bs
        self.batch_ranges = batch_ranges(max_bs)
        self.max_context = max_context
        self.cache_dir = cache_dir
        self._device = kv_pool.k[0].device
        self._half = kv_pool.dtype in (torch.bfloat16, torch.float16)
        self._key_pos: dict[int, torch.Tensor] = {}  # width -> arange(width), made once each
        # The pool's and the table's sizes are compiled symbolic too (they follow --max-running-
        # requests, the context length and the KV budget): the graphs do not depend on them.
        for t in (*kv_pool.k, *kv_pool.v):
            torch._dynamo.maybe_mark_dynamic(t, 1)
        torch._dynamo.maybe_mark_dynamic(req_to_token.table, 0)
        torch._dynamo.maybe_mark_dynamic(req_to_token.table, 1)
        self._step: Callable[..., torch.Tensor] | None = None
        self._step_lora: Callable[..., torch.Tensor] | None = None
        # (packed rows, one-row batch) -> its graph, called without dynamo (direct_graph.py)
        self._direct: dict[tuple[int, bool], DirectGraph] = {}
        self.direct_steps = 0  # steps that ran so

    def _sizes(self, lo: int, hi: int) -> str:
        """A range's batch sizes this step serves (its graph is compiled for the whole range)."""
        return str(lo) if lo == hi else f"{lo}-{min(hi, self.max_bs)}"

    def describe(self) -> str:
        sizes = "batch sizes " + ", ".join(self._sizes(lo, hi) for lo, hi in self.batch_ranges)
        return sizes if self.lora is None else sizes + ", with and without LoRA adapters"

    def _key_positions(self, width: int) -> torch.Tensor:
        key_pos = self._key_pos.get(width)
        if key_pos is None:
            key_pos = self._key_pos[width] = torch.arange(width, device=self._device)
            torch._dynamo.mark_dynamic(key_pos, 0)
        return key_pos

    def _forward(self, packed: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """packed: [5, B] rows input ids, positions, request slots, lengths, KV slots."""
        return self._logits(packed, key_pos, None)

    def _forward_lora(self, packed: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """A batch with LoRA adapters: packed [6, B], the rows' adapter slots last. Its own entry
        point: dynamo keeps its graphs apart from the plain ones (one code object's cache would
        mix their guards, and the mixed batches ran 20% slower)."""
        assert self.lora is not None
        return self._logits(packed[:5], key_pos, RowSlotLoRA(self.lora, packed[5]))

    def _logits(self, packed: torch.Tensor, key_pos: torch.Tensor, lora: RowSlotLoRA | None) -> torch.Tensor:
        input_ids, positions, req_slots, seq_lens, out_cache_loc = packed.unbind(0)
        inputs = _DecodeInputs(positions, out_cache_loc, self.attn.metadata(req_slots, seq_lens, key_pos), lora)
        return self.model.logits(self.model(input_ids, inputs, self.attn))

    def prepare(self, progress: Progress) -> float:
        """Compile the graph of every batch range by running it once on padding rows. Raises
        CompileFailed."""
        # Inductor reads its cache location when it compiles.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir
        variants = (5,) if self.lora is None else (5, 6)  # packed rows: without, with LoRA
        n = len(self.batch_ranges) * len(variants)
        limits = torch._dynamo.config
        # Room for this step's graphs on top of any other model's in the process (a benchmark or
        # a test compiles several: all share `_forward`'s code object and dynamo's limits).
        limits.cache_size_limit += 2 * n
        limits.accumulated_cache_size_limit += 4 * n
        # The C++ wrapper calls the graph's kernels from C++ rather than Python: ~15% off a
        # stories260K step at batch 1 (docs/benchmarks.md), for a longer first compile.
        # In bfloat16 or float16 every op rounds its result as eager does (inductor would keep fused
        # intermediates in float32): the compiled step gives the eager step's, and transformers', tokens.
        # No size asserts: the graph checked every input's sizes and strides at each call (~20 us of
        # stories260K's 170 us one-row step), which dynamo's guards ensure, and the direct calls
        # make as the first call made them (direct_graph.py).
        options: dict[str, str | int | bool | Callable[..., Any]] = {
            "cpp_wrapper": True, "emulate_precision_casts": self._half, "size_asserts": False}
        capture = GraphCapture(options)  # inductor, each graph kept to be called directly
        steps = {rows: torch.compile(fn, dynamic=False, fullgraph=True, backend=capture)
                 for rows, fn in ((5, self._forward), (6, self._forward_lora))}
        start = time.perf_counter()
        try:
            with _quiet_torch_logs():
                graphs = [(lo, hi, rows) for lo, hi in self.batch_ranges for rows in variants]
                for i, (lo, hi, rows) in enumerate(graphs):
                    what = " with LoRA" if rows == 6 else ""
                    progress(f"compiling the decode step for batch sizes {self._sizes(lo, hi)}{what} ({i + 1}/{n})")
                    # Made as run() makes its input: one fresh inference-mode tensor, whose
                    # rows do not alias each other. Any difference (aliased inputs, a tensor
                    # from outside inference mode) compiles a graph no real batch matches.
                    with torch.inference_mode():
                        packed = torch.zeros((rows, lo), dtype=torch.int64, device=self._device)
                        packed[3] = 1
                        if lo < hi:
                            torch._dynamo.mark_dynamic(packed, 1, min=lo, max=hi)
                        for width in {context_width(2, self.max_context), self.max_context}:
                            steps[rows](packed, self._key_positions(width))
        except Exception as exc:  # any compiler failure means: stay eager
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise CompileFailed(f"{type(exc).__name__}: {first_line}") from exc
        self._step, self._step_lora = steps[5], steps[6]
        self._direct = {(rows, one): g for rows in variants for one, g in capture.direct(rows).items()}
        return time.perf_counter() - start

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        assert self._step is not None, "prepare() first"
        assert batch.input_ids is not None  # set before any forward
        width = context_width(batch.max_seq_len, self.max_context)
        # One fresh tensor: the graph's input always has the layout it was compiled for.
        positions = batch.positions if batch.rope_positions is None else batch.rope_positions  # only the rotary reads them
        rows = [batch.input_ids, positions, batch.req_slots, batch.seq_lens, batch.out_cache_loc]
        if batch.lora is not None:  # adapters in the batch: the graphs with LoRA
            rows.append(torch.tensor(batch.lora.row_slots, dtype=torch.int64, device=self._device))
        packed, key_pos = torch.stack(rows), self._key_positions(width)
        direct = self._direct.get((packed.shape[0], packed.shape[1] == 1))
        if direct is not None:
            self.direct_steps += 1
            return direct.run(packed, key_pos)
        step = self._step if batch.lora is None else self._step_lora
        assert step is not None
        return step(packed, key_pos)
