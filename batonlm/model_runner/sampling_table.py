"""SlotSamplingTable: each request slot's sampling record, kept on the device.

A request's `SlotSampling` is written once, when it starts on a slot; a launch then only names
slots and positions, and `gather` turns them into the per-row tensors the sampler reads.
"""

from __future__ import annotations

import torch

from batonlm.ipc.device_messages import SlotSampling
from batonlm.kernels import penalties
from batonlm.kernels import sampling as ref
from batonlm.kernels.penalties import PenaltyBatch
from batonlm.kernels.sampling import DrawBatch
from batonlm.model_runner.host_to_device import to_device
from batonlm.model_runner.sampler import SamplingBatch
from batonlm.sampling_params import LogitChanges


class SlotSamplingTable:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device | str) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)

        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(num_slots, dtype=dtype, device=self.device)

        self.temperature = z(torch.float32)  # 0 for greedy requests
        self.top_k = z(torch.int64)
        self.top_p = z(torch.float32)
        self.min_p = z(torch.float32)
        self.seed_lo = z(torch.int64)
        self.seed_hi = z(torch.int64)
        self.prompt_len = z(torch.int64)
        self.min_new_tokens = z(torch.int64)
        self.frequency = z(torch.float32)
        self.presence = z(torch.float32)
        self.repetition = torch.ones(num_slots, dtype=torch.float32, device=self.device)
        # Per-slot id lists (-1 = padding), as wide as the longest list seen so far.
        self.stop_ids = self._ids_table(0)
        self.bias_ids = self._ids_table(0)
        self.bias_values = torch.zeros((num_slots, 0), dtype=torch.float32, device=self.device)
        # [num_slots, V] tables, allocated when the first request with penalties arrives.
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def _ids_table(self, width: int) -> torch.Tensor:
        return torch.full((self.num_slots, width), -1, dtype=torch.int64, device=self.device)

    def _widen(self, table: torch.Tensor, width: int, fill: float) -> torch.Tensor:
        if width <= table.shape[1]:
            return table
        grown = torch.full((self.num_slots, width), fill, dtype=table.dtype, device=self.device)
        grown[:, : table.shape[1]] = table
        return grown

    def _set_list(self, table: torch.Tensor, slot: int, values: list, dtype: torch.dtype, fill: float) -> torch.Tensor:
        table = self._widen(table, len(values), fill)
        table[slot] = fill
        if values:
            table[slot, : len(values)] = to_device(values, dtype, self.device)
        return table

    def init_slot(self, rec: SlotSampling) -> None:
        """Write the record of a request starting on `rec.req_slot`."""
        p, slot = rec.params, rec.req_slot
        lo, hi = ref.split_seed(rec.seed)
        self.temperature[slot] = 0.0 if p.is_greedy else p.temperature
        # Off (-1 or 0) is stored as -1; a top-k beyond the vocabulary filters nothing.
        self.top_k[slot] = min(p.top_k, self.vocab_size) if p.top_k >= 1 else -1
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.seed_lo[slot] = lo
        self.seed_hi[slot] = hi
        self.prompt_len[slot] = rec.prompt_len
        self.min_new_tokens[slot] = p.min_new_tokens
        self.frequency[slot] = p.frequency_penalty
        self.presence[slot] = p.presence_penalty
        self.repetition[slot] = p.repetition_penalty
        stops = sorted(rec.stop_ids) if p.min_new_tokens > 0 else []
        self.stop_ids = self._set_list(self.stop_ids, slot, stops, torch.int64, -1)
        self.bias_ids = self._set_list(self.bias_ids, slot, list(p.logit_bias), torch.int64, -1)
        self.bias_values = self._set_list(self.bias_values, slot, list(p.logit_bias.values()), torch.float32, 0.0)
        if p.counts_tokens:
            if self.output_counts is None:
                shape = (self.num_slots, self.vocab_size)
                self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
                self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
            assert self.prompt_mask is not None
            ids = to_device(rec.prompt_ids, torch.int64, self.device)
            penalties.reset_slot(self.output_counts, self.prompt_mask, slot, ids)
            if rec.output_ids:  # a request resuming after a retraction: its outputs so far
                outs = to_device(rec.output_ids, torch.int64, self.device)
                penalties.update_output_counts(self.output_counts, torch.full_like(outs, slot), outs)

    def record_outputs(self, req_slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the sampled tokens of a batch with penalties (their penalties read the counts)."""
        if self.output_counts is not None:
            penalties.update_output_counts(self.output_counts, req_slots, token_ids)

    def gather(
        self, req_slots: torch.Tensor, seq_lens: torch.Tensor, all_greedy: bool,
        logit_changes: LogitChanges = LogitChanges.NONE, top_logprobs: int = -1,
    ) -> SamplingBatch:
        """The sampling inputs of a batch whose rows are `req_slots`, each sampling the token
        that follows `seq_lens` tokens. Penalties that count tokens read the count tables in one
        fused pass with the bias; logit bias alone is only added."""
        banned = self.stop_ids[req_slots]
        if banned.shape[1] or not all_greedy:
            out_index = seq_lens - self.prompt_len[req_slots]  # the output position being sampled
        if banned.shape[1]:
            under_min = out_index < self.min_new_tokens[req_slots]
            banned = torch.where(under_min[:, None], banned, torch.full_like(banned, -1))
        batch = SamplingBatch(banned=banned, top_logprobs=top_logprobs)
        if logit_changes == LogitChanges.BIAS:
            batch.bias = (self.bias_ids[req_slots], self.bias_values[req_slots])
        elif logit_changes == LogitChanges.COUNTED:
            assert self.output_counts is not None and self.prompt_mask is not None
            batch.penalties = PenaltyBatch(
                req_slots=req_slots,
                output_counts=self.output_counts,
                prompt_mask=self.prompt_mask,
                frequency=self.frequency[req_slots],
                presence=self.presence[req_slots],
                repetition=self.repetition[req_slots],
                bias_ids=self.bias_ids[req_slots],
                bias_values=self.bias_values[req_slots],
            )
        if not all_greedy:
            batch.draw = DrawBatch(
                temperature=self.temperature[req_slots],
                top_k=self.top_k[req_slots],
                top_p=self.top_p[req_slots],
                min_p=self.min_p[req_slots],
                keys=ref.row_keys(self.seed_lo[req_slots], self.seed_hi[req_slots], out_index),
            )
        return batch
