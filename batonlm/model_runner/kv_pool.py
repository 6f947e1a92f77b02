"""Physical KV memory: per-layer, token-granular K and V buffers indexed by KV slot."""

from __future__ import annotations

import torch


class KVPool:
    """`k[layer][:, slot]` and `v[layer][:, slot]` hold one token's keys/values ([kv_heads, head_dim]).

    Head-major ([kv_heads, slots, head_dim]): gathering a batch's context along the slot axis
    gives [kv_heads, tokens, head_dim] contiguous, the layout attention reads without a copy.
    Slot 0 is never handed out by the allocator: it is the padding target that gathers and
    writes of padded rows point at, so it may hold garbage.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_kv_heads, num_slots, head_dim)
        self.num_slots = num_slots
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] of the tokens going to `slots`."""
        self.k[layer][:, slots] = k.transpose(0, 1)
        self.v[layer][:, slots] = v.transpose(0, 1)

    def gather(
        self, layer: int, slots: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, len(slots), head_dim] keys and values (contiguous copies), into `out` when
        given: reusing one buffer for every layer saves allocating (and page-faulting) megabytes
        per layer."""
        if out is None:
            return self.k[layer].index_select(1, slots), self.v[layer].index_select(1, slots)
        torch.index_select(self.k[layer], 1, slots, out=out[0])
        torch.index_select(self.v[layer], 1, slots, out=out[1])
        return out

    def gather_buffers(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        kvh, _, d = self.k[0].shape
        k = self.k[0]
        return k.new_empty((kvh, num_tokens, d)), k.new_empty((kvh, num_tokens, d))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
