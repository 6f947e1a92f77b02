"""Which part of every weight a tensor-parallel rank holds (Megatron's layout).

Column-parallel (output features split): the q/k/v projections by attention head, gate/up by
intermediate feature. Row-parallel (input features split, one all-reduce after): o_proj by
head, down_proj by intermediate feature. The embedding and the LM head are split by vocabulary
row, the vocabulary padded to a multiple of the rank count. When there are more ranks than KV
heads, each KV head is replicated on `size // num_kv_heads` consecutive ranks — the ranks whose
query heads use it. The intermediate size may split unevenly (the first ranks take one more);
attention heads may not.
"""

from __future__ import annotations

from dataclasses import dataclass


class TPConfigError(ValueError):
    """The model cannot be split over this many ranks; the message says why."""


def split_evenly(total: int, size: int, rank: int) -> tuple[int, int]:
    """(start, length) of rank's part of `total` items split as evenly as possible."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)


@dataclass(frozen=True)
class TPLayout:
    rank: int
    size: int
    num_heads: int  # the model's
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise TPConfigError(f"rank {self.rank} is outside 0..{self.size - 1}")
        check_split(self.size, self.num_heads, self.num_kv_heads, self.intermediate_size)

    @classmethod
    def single(cls, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, vocab: int) -> TPLayout:
        return cls(0, 1, num_heads, num_kv_heads, head_dim, intermediate, vocab)

    # ---------------------------------------------------------------- attention
    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.size

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (1 unless there are more ranks than KV heads)."""
        return max(1, self.size // self.num_kv_heads)

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank."""
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        return self.rank // self.kv_replicas * self.kv_heads

    def q_rows(self) -> tuple[int, int]:
        """(start, count) of this rank's rows of q_proj (its heads' output features)."""
        return self.rank * self.heads * self.head_dim, self.heads * self.head_dim

    def kv_rows(self) -> tuple[int, int]:
        """(start, count) of this rank's rows of k_proj and v_proj."""
        return self.first_kv_head * self.head_dim, self.kv_heads * self.head_dim

    # ---------------------------------------------------------------- MLP
    def mlp_rows(self) -> tuple[int, int]:
        """(start, count) of this rank's intermediate features (rows of gate/up, columns of down)."""
        return split_evenly(self.intermediate_size, self.size, self.rank)

    # ---------------------------------------------------------------- vocabulary
    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.size) * self.size

    def vocab_rows(self) -> tuple[int, int]:
        """(start, count) of this rank's rows of the padded vocabulary (embedding, LM head)."""
        per = self.padded_vocab // self.size
        return self.rank * per, per

    def vocab_rows_in_checkpoint(self) -> tuple[int, int]:
        """The part of `vocab_rows` the checkpoint has (the padding rows past it stay zero)."""
        start, count = self.vocab_rows()
        return start, max(0, min(count, self.vocab_size - start))


def check_split(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise TPConfigError when `size` ranks cannot split these attention heads."""
    if size < 1:
        raise TPConfigError(f"tensor parallel size must be at least 1, got {size}")
    if num_heads % size:
        raise TPConfigError(
            f"cannot split {num_heads} attention heads over {size} ranks: the tensor parallel size must divide "
            f"num_attention_heads"
        )
    if num_kv_heads >= size and num_kv_heads % size:
        raise TPConfigError(
            f"cannot split {num_kv_heads} KV heads over {size} ranks: the tensor parallel size must divide "
            f"num_key_value_heads (or be a multiple of it, to replicate them)"
        )
    if num_kv_heads < size and size % num_kv_heads:
        raise TPConfigError(
            f"cannot replicate {num_kv_heads} KV heads over {size} ranks: the tensor parallel size must be a "
            f"multiple of num_key_value_heads when it is larger"
        )
    if intermediate_size < size:
        raise TPConfigError(f"cannot split an intermediate size of {intermediate_size} over {size} ranks")
