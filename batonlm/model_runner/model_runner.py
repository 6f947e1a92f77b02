"""ModelRunner: owns the model, the KV memory and the sampler on one device."""

from __future__ import annotations

import logging

import torch

from batonlm.distributed.group import TPGroup
from batonlm.ipc.device_messages import LoRALoad, LoRAMessage, LoRAPlace
from batonlm.model_runner import linear
from batonlm.model_runner.decode_graphs import DecodeGraphs, Progress
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.host_to_device import to_device
from batonlm.model_runner.kv_pool import KVPool, kv_cache_dtype
from batonlm.model_runner.lora import LoRAWeights, read_adapter
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_loader import load_model
from batonlm.model_runner.prompt_logprobs import score_tokens
from batonlm.model_runner.req_to_token import ReqToTokenPool
from batonlm.model_runner.sampler import SampleOutput
from batonlm.model_runner.sampling_table import SlotSamplingTable
from batonlm.registries import ATTENTION_BACKENDS, SAMPLERS
from batonlm.sampling_params import LogitChanges

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs forward passes over a `ForwardBatch` and samples their next tokens.

    `kv_capacity` counts usable KV slots; the pool has one more (slot 0, padding).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype,
        device: str,
        kv_capacity: int,
        num_req_slots: int,
        context_length: int,
        attention_backend: str,
        sampler: str,
        tp: TPGroup | None = None,
        mlp_group: TPGroup | None = None,
        kv_cache: str = "auto",
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = tp or TPGroup.single()
        self.model, self.load_stats = load_model(cfg, dtype, self.device, self.tp, mlp_group=mlp_group)
        if self.device.type == "cpu":  # the large projections' weights reordered once for oneDNN (linear.py)
            linear.pack(self.model.projection_weights())
        # This rank's heads (all of them without tensor parallelism); MLA: one latent KV head.
        self.num_heads = self.model.shard.heads
        self.num_kv_heads = 1 if cfg.mla else self.model.shard.kv_heads
        self.kv_pool = self._kv_pool(kv_capacity + 1, kv_cache)
        self.req_to_token = ReqToTokenPool(num_req_slots, context_length, self.device)
        self.attn = ATTENTION_BACKENDS[attention_backend](
            self.kv_pool, self.req_to_token, self.num_heads, self.num_kv_heads, cfg.kv_head_dim, cfg.sliding_windows,
            cfg.attention_scale, cfg.attn_logit_softcap,
        )
        self.attn.has_sinks = self.model.attention_sinks
        self.sampler = SAMPLERS[sampler]()
        self.sampling_table = SlotSamplingTable(num_req_slots, cfg.vocab_size, self.device)
        self.context_length = context_length
        # LongRoPE: where the rotary's long-factor table starts (layers.RotaryEmbedding).
        self.long_rope_offset = cfg.max_position_embeddings
        self.lora: LoRAWeights | None = None  # use_lora: the adapters, slot 1..
        # Set by use_decode_graphs: runs the all-decode batches that fit it.
        self.decode_graphs: DecodeGraphs | None = None
        self.graph_steps = 0  # decode batches run through them

    def _kv_pool(self, num_slots: int, kv_cache: str) -> KVPool:
        """The KV pool stored as `--kv-cache-dtype` says: the model's dtype (auto), or FP8 with
        the checkpoint's per-layer scales (1.0 where it has none, said once by rank 0)."""
        cfg, cache_dtype = self.cfg, kv_cache_dtype(kv_cache, self.dtype)
        latent = cfg.mla is not None
        if cache_dtype == self.dtype:
            return KVPool(num_slots, cfg.num_layers, self.num_kv_heads, cfg.kv_head_dim, self.dtype, self.device,
                          latent=latent)
        from batonlm.model_runner.kv_scales import read_kv_scales, warn_missing

        scales = read_kv_scales(cfg.path, cfg.num_layers)
        if self.tp.rank == 0:
            warn_missing(scales, kv_cache, torch.finfo(cache_dtype).max)
        return KVPool(num_slots, cfg.num_layers, self.num_kv_heads, cfg.kv_head_dim, self.dtype, self.device,
                      cache_dtype, scales.k, scales.v, latent)

    def use_lora(self, slots: int, rank: int, adapters: tuple[tuple[str, str], ...]) -> None:
        """Room for `slots` LoRA adapters of rank up to `rank` on the device (slot 0: the base
        model); the --lora-paths adapters (name, PEFT directory) held as loads 1.. and the first
        `slots` of them placed in slots 1.. (the scheduler's `LoRASlots` starts so too)."""
        self.lora = LoRAWeights(slots, rank, self.cfg, self.model.shard, self.dtype, self.device)
        for key, (name, path) in enumerate(adapters, start=1):
            self.update_lora(LoRALoad(key, name, path))
            if key <= slots:
                self.update_lora(LoRAPlace(key, key))

    def update_lora(self, msg: LoRAMessage) -> None:
        """Hold an adapter (checked where it was asked for), place one in a slot, or drop one."""
        assert self.lora is not None, "LoRA adapters need LoRA slots (use_lora)"
        if isinstance(msg, LoRALoad):
            self.lora.load(msg.key, read_adapter(msg.name, msg.path, self.lora.rank))
        elif isinstance(msg, LoRAPlace):
            self.lora.place(msg.slot, msg.key)
        else:
            self.lora.drop(msg.key)

    def use_decode_graphs(self, graphs: DecodeGraphs, progress: Progress) -> None:
        """Build `graphs` (compile or capture every bucket) and run decode batches through them.
        A CPU compile failure leaves the step eager with one warning; a CUDA capture failure is
        a start-up error (it may have left the device in a bad state)."""
        from batonlm.model_runner.compiled_decode import CompileFailed

        try:
            seconds = graphs.prepare(progress)
        except CompileFailed as e:
            logger.warning("the decode step could not be compiled, running it eagerly: %s", e)
            return
        progress(f"decode step ready: {type(graphs).__name__}, {graphs.describe()}, "
                 f"{seconds:.1f} s")
        self.decode_graphs = graphs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Write the batch's KV slots into the req-to-token table, run the model, and return the
        float32 logits of each row's last token ([B, V])."""
        self._write_table(batch)
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            self.graph_steps += 1
            return self.decode_graphs.run(batch)
        return self.model.logits(self._hidden(batch)[batch.last_token_index])

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning the hidden states of every token (always eager: the
        graph-backed steps keep only the last token's)."""
        self._write_table(batch)
        hidden = self._hidden(batch)
        return self.model.logits(hidden[batch.last_token_index]), hidden

    @torch.inference_mode()
    def pool(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Embeddings: per (first flat token index, count) span, the float32 sum of its tokens'
        last hidden states ([S, H]), all spans in one gather and one index_add."""
        starts, counts = (to_device(v, torch.int64, hidden.device) for v in zip(*spans))
        total = sum(count for _, count in spans)  # a host fact: no device sync for the shapes
        seg = torch.repeat_interleave(torch.arange(len(spans), device=hidden.device), counts, output_size=total)
        # Each token's flat index: its span's start plus its place in the span.
        at = starts[seg] + torch.arange(total, device=hidden.device) - (counts.cumsum(0) - counts)[seg]
        out = torch.zeros(len(spans), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, seg, self.model.final_norm(hidden[at]).float())

    @torch.inference_mode()
    def idle_forward(self, dp_tokens: list[int]) -> None:
        """DP attention: this rank has no tokens; take its part in the other ranks' MLPs."""
        self.model.idle_forward(dp_tokens)

    def _hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The eager model's final hidden states of every token of the batch."""
        self.attn.prepare(batch)
        return self.model(batch.input_ids, batch, self.attn)

    @torch.inference_mode()
    def score_prompt(
        self, hidden: torch.Tensor, targets: torch.Tensor, top_n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompt logprobs of `targets` from the hidden states of the positions before them."""
        return score_tokens(self.model.logits, self.sampler, hidden, targets, top_n, self.cfg.vocab_size)

    def _write_table(self, batch: ForwardBatch) -> None:
        if batch.max_extend_len == 1:  # a decode batch: one token per row
            row_of_token = batch.req_slots
        else:
            row_of_token = torch.repeat_interleave(batch.req_slots, batch.extend_lens, output_size=batch.num_tokens)
        self.req_to_token.write(row_of_token, batch.positions, batch.out_cache_loc)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, batch: ForwardBatch, *, all_greedy: bool, logit_changes: LogitChanges,
        top_logprobs: int, output_rows: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Sample every row; with penalties that count tokens, count the tokens of the rows whose
        token is an output (`output_rows`, None: all)."""
        table = self.sampling_table
        sampling = table.gather(batch.req_slots, batch.seq_lens, all_greedy, logit_changes, top_logprobs)
        out = self.sampler.sample(logits, sampling)
        if logit_changes == LogitChanges.COUNTED:
            if output_rows is None:
                table.record_outputs(batch.req_slots, out.token_ids)
            else:
                table.record_outputs(batch.req_slots[output_rows], out.token_ids[output_rows])
        return out
