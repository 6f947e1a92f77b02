"""MXFP4 activations (`kernels/mxfp4.py`) against their definition in float64: compressed-tensors'
exponent rule at its boundary (an amax mantissa of 1.75 rounds up), E2M1's ties to the even
mantissa, zero groups, a ragged last group. (The `mxfp4` fixture's logits check the whole against
compressed-tensors' own `fake_quantize`: test_quantized_checkpoints.py.)"""

from __future__ import annotations

import math

import torch

from batonlm.kernels.mxfp4 import ct_mxfp4_fake_quant

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _reference(row: list[float]) -> list[float]:
    """One group of up to 32 values, in float64 from the definition."""
    amax = max(abs(v) for v in row)
    if amax == 0:
        return [0.0] * len(row)
    m, x = math.frexp(amax)  # amax = m 2^x, m in [0.5, 1)
    p = x - 1 + (1 if 2 * m >= 1.75 else 0)
    scale = 2.0 ** (p - 2)
    out = []
    for v in row:
        mag = min(abs(v) / scale, 6.0)
        best = min(E2M1, key=lambda e: (abs(e - mag), E2M1.index(e) % 2))  # nearest; a tie to the even index
        out.append(math.copysign(best * scale, v) if best else 0.0)
    return out


def test_the_exponent_rule_ties_and_zero_groups() -> None:
    rows = [
        [1.75] + [0.0] * 31,  # mantissa 1.75: 2^1, scale 2^-1 -> 1.75 / 0.5 = 3.5 -> 4 (tie to even) -> 2.0
        [1.74] + [0.8] * 31,  # below 1.75: 2^0, scale 2^-2 -> 6.96 clamps to 6 -> 1.5; 0.8 / 0.25 = 3.2 -> 3
        [6.0, 0.75, 1.25, 2.5, -5.0, 3.5, 0.25] + [0.0] * 25,  # scale 1: every E2M1 tie (to the even mantissa)
        [0.0] * 32,
    ]
    x = torch.tensor(rows, dtype=torch.float32)
    got = ct_mxfp4_fake_quant(x)
    want = torch.tensor([_reference(r) for r in rows], dtype=torch.float32)
    assert torch.equal(got, want), (got - want).abs().max()
    assert got[0, 0] == 2.0 and got[1, 0] == 1.5 and got[1, 1] == 0.75 and bool((got[3] == 0).all())


def test_random_rows_with_a_ragged_last_group_match_the_definition() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 70, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    got = ct_mxfp4_fake_quant(x.to(torch.bfloat16).float())
    xs = x.to(torch.bfloat16).float()
    want = torch.tensor([sum((_reference(r[i : i + 32].tolist()) for i in range(0, 70, 32)), []) for r in xs])
    assert torch.equal(got, want.float())
    assert ct_mxfp4_fake_quant(x.to(torch.bfloat16)).dtype == torch.bfloat16
