"""A quantized checkpoint seen as the float checkpoint it means: each quantized layer's tensors
(`formats.find_linears`) appear as one `<prefix>.weight` [N, K], dequantized when read, and
every other tensor as it is. The weight loader reads it as it reads any checkpoint, so tensor
parallelism (a rank's rows or columns of the float weight), fused projections, LoRA and the
compiled decode step need nothing of their own (docs/quantization.md: what runs where).

gpt-oss's MXFP4 experts (`mxfp4_experts.py`) appear as transformers' stacked parameters
(`<experts>.gate_up_proj` [E, K, N]), the model the transformers fallback builds.

With `--quantization fp8` on a float checkpoint (`QuantConfig.online`), each projection's
weight is rounded to FP8 e4m3 with one scale per output channel as it is read (where the
projections stay FP8, `resident.py` keeps the codes and scales instead: `online_linears`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from batonlm.model_runner.checkpoint import Checkpoint
from batonlm.model_runner.quantization import mxfp4_experts
from batonlm.model_runner.quantization.config import QuantConfig
from batonlm.model_runner.quantization.formats import QuantizedLinear, dequantize, find_linears

# The float weights online FP8 rounds: attention and MLP projections, and experts' (not
# embeddings, the LM head, norms or routers).
_PROJECTION = re.compile(r"(_proj|\.experts\.\d+\.w[123])\.weight$")
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] in FP8 e4m3 with one float32 scale per row (amax / 448; 1 for a zero row):
    (codes [N, K], scales [N])."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale[:, 0]


def fp8_round_per_channel(w: torch.Tensor) -> torch.Tensor:
    """`w` [N, K] rounded to FP8 e4m3 with one scale per row (amax / 448) and back, in float32."""
    q, scale = fp8_per_channel(w)
    return q.to(torch.float32) * scale[:, None]


def online_linears(ckpt: Checkpoint) -> dict[str, QuantizedLinear]:
    """Every float projection `--quantization fp8` rounds, as a layer that can stay FP8
    (storage "online": its codes and scales computed from the float weight when it is read)."""
    return {name: QuantizedLinear(name.removesuffix(".weight"), "online", (name,), (shape[0], shape[1]))
            for name in ckpt.names() if _PROJECTION.search(name) and len(shape := ckpt.shape(name)) == 2}


class DequantizedCheckpoint(Checkpoint):
    """`ckpt`'s tensors under `quant`, as float ones (`Checkpoint`'s interface)."""

    def __init__(self, files: list[Path], quant: QuantConfig) -> None:
        super().__init__(files)
        self.quant = quant
        self.linears: dict[str, QuantizedLinear] = {}
        self.stacked: dict[str, tuple[str, str]] = {}  # gpt-oss's MXFP4 experts: parameter -> (blocks, scales)
        self._consumed: set[str] = set()

    def __enter__(self) -> DequantizedCheckpoint:
        super().__enter__()
        if self.quant.method == "mxfp4":
            self.stacked = mxfp4_experts.find(set(super().names()))
            self._consumed = {m for pair in self.stacked.values() for m in pair}
        elif not self.quant.online:
            self.linears = find_linears(self, self.quant)
            self._consumed = {m for lin in self.linears.values() for m in lin.members}
        return self

    def names_by_file(self) -> list[tuple[Path, list[str]]]:
        out = []
        for f, names in super().names_by_file():
            shown = [n for n in names if n not in self._consumed]
            shown += [w for w, lin in self.linears.items() if lin.members[0] in names]
            shown += [p for p, (blocks, _) in self.stacked.items() if blocks in names]
            out.append((f, shown))
        return out

    def names(self) -> list[str]:
        return [n for _, names in self.names_by_file() for n in names]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.stacked:
            return mxfp4_experts.shape(self, self.stacked[name][0])
        lin = self.linears.get(name)
        return lin.shape if lin is not None else super().shape(name)

    def nbytes(self, name: str) -> int:
        if name in self.stacked:
            return sum(Checkpoint.nbytes(self, m) for m in self.stacked[name])
        lin = self.linears.get(name)
        return super().nbytes(name) if lin is None else sum(Checkpoint.nbytes(self, m) for m in lin.members)

    def read(self, name: str, dim: int = 0, start: int = 0, count: int | None = None) -> torch.Tensor:
        lin = self.linears.get(name)
        if name in self.stacked:
            w = mxfp4_experts.dequantize(self, *self.stacked[name])
        elif lin is None:
            if not (self.quant.online and _PROJECTION.search(name) and len(super().shape(name)) == 2):
                return super().read(name, dim, start, count)
            w = fp8_round_per_channel(super().get(name))
        else:
            w = dequantize(self, lin, self.quant)
        return w if count is None else w.narrow(dim, start, count)
