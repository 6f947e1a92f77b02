"""The sampler interface, its registry, and the per-request-slot sampling table."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from batonlm.kernels import sampling as ref


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one batch (device tensors)."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, -1 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    keys: torch.Tensor  # [B] int64 counter keys from (seed, output position)
    banned: torch.Tensor  # [B, S] int64 ids masked to -inf (-1 = padding)
    all_greedy: bool


class Sampler(ABC):
    name: ClassVar[str]

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 logits [B, V] -> next token ids [B] int64."""


SAMPLERS: dict[str, type[Sampler]] = {}


def register_sampler(cls: type[Sampler]) -> type[Sampler]:
    SAMPLERS[cls.name] = cls
    return cls


def get_sampler(name: str) -> Sampler:
    try:
        return SAMPLERS[name]()
    except KeyError:
        raise ValueError(f"sampler {name!r} is not known (known: {sorted(SAMPLERS)})") from None


@register_sampler
class TorchSampler(Sampler):
    """The plain-torch reference path (used on the CPU)."""

    name = "torch"

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = ref.suppress_tokens(logits, batch.banned)
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        return ref.sample_reference(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.keys)


class SlotSamplingTable:
    """Sampling parameters of each request slot, written once when a request starts, so that
    a launch only names slots and positions."""

    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(num_slots, dtype=dtype, device=device)

        self.device = device
        self.temperature = z(torch.float32)
        self.top_k = z(torch.int64)
        self.top_p = z(torch.float32)
        self.min_p = z(torch.float32)
        self.seed_lo = z(torch.int64)
        self.seed_hi = z(torch.int64)
        self.prompt_len = z(torch.int64)
        self.min_new_tokens = z(torch.int64)
        self.stop_ids = torch.full((num_slots, 0), -1, dtype=torch.int64, device=device)

    def init_slot(
        self,
        slot: int,
        *,
        prompt_len: int,
        temperature: float,
        top_k: int,
        top_p: float,
        min_p: float,
        seed: int,
        min_new_tokens: int,
        stop_ids: list[int],
    ) -> None:
        lo, hi = ref.split_seed(seed)
        self.temperature[slot] = temperature
        self.top_k[slot] = top_k
        self.top_p[slot] = top_p
        self.min_p[slot] = min_p
        self.seed_lo[slot] = lo
        self.seed_hi[slot] = hi
        self.prompt_len[slot] = prompt_len
        self.min_new_tokens[slot] = min_new_tokens
        if len(stop_ids) > self.stop_ids.shape[1]:
            grown = torch.full((self.stop_ids.shape[0], len(stop_ids)), -1, dtype=torch.int64, device=self.device)
            grown[:, : self.stop_ids.shape[1]] = self.stop_ids
            self.stop_ids = grown
        self.stop_ids[slot] = -1
        if stop_ids:
            self.stop_ids[slot, : len(stop_ids)] = torch.tensor(stop_ids, dtype=torch.int64)

    def gather(self, req_slots: torch.Tensor, seq_lens: torch.Tensor, all_greedy: bool) -> SamplingBatch:
        out_index = seq_lens - self.prompt_len[req_slots]
        banned = self.stop_ids[req_slots]
        if banned.shape[1]:
            under_min = out_index < self.min_new_tokens[req_slots]
            banned = torch.where(under_min[:, None], banned, torch.full_like(banned, -1))
        return SamplingBatch(
            temperature=self.temperature[req_slots],
            top_k=self.top_k[req_slots],
            top_p=self.top_p[req_slots],
            min_p=self.min_p[req_slots],
            keys=ref.row_keys(self.seed_lo[req_slots], self.seed_hi[req_slots], out_index),
            banned=banned,
            all_greedy=all_greedy,
        )
