"""Inputs and independent expectations shared by the kernel tests."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import pytest
import torch

from batonlm.kernels import sampling as ref
from batonlm.kernels.penalties import PenaltyBatch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The CPU tests give the kernels CPU tensors, which only the interpreter takes.
interpreted_only = pytest.mark.skipif(
    not INTERPRETED, reason="CPU kernel tests need TRITON_INTERPRET=1 (the default without CUDA); the gpu tests cover CUDA"
)
# The compiled kernels on a CUDA device (the `gpu` tests), not under the interpreter.
compiled_only = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="compiled kernels on CUDA only")
# An entry point's two implementations: the torch reference, and the Triton kernel (interpreted).
IMPLS = [pytest.param(False, id="torch"), pytest.param(True, id="triton", marks=interpreted_only)]
def bad_argument_test(calls: Callable[[], dict[str, Callable[[bool], object]]]) -> Callable[[bool, str], None]:
    """A kernel file's bad-argument test: `calls()` maps each argument's name to a call with that
    argument wrong (taking `use_triton`); each, on both implementations, must raise one ValueError
    that starts with the argument's name."""

    @pytest.mark.parametrize("use_triton", IMPLS)
    @pytest.mark.parametrize("name", list(calls()))
    def test_a_bad_argument_is_named(use_triton: bool, name: str) -> None:
        with pytest.raises(ValueError, match=f"^{name}:"):
            calls()[name](use_triton)

    return test_a_bad_argument_is_named


# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def keys_for(seeds: list[int], positions: list[int]) -> torch.Tensor:
    halves = [ref.split_seed(s) for s in seeds]
    return ref.row_keys(
        torch.tensor([h[0] for h in halves]), torch.tensor([h[1] for h in halves]), torch.tensor(positions)
    )


def params(rows: list[tuple[float, int, float, float]], device: str = "cpu"):
    """(temperature, top_k, top_p, min_p) per row -> the four [B] tensors."""
    temp, k, p, m = zip(*rows)
    return (
        torch.tensor(temp, dtype=torch.float32, device=device),
        torch.tensor(k, dtype=torch.int64, device=device),
        torch.tensor(p, dtype=torch.float32, device=device),
        torch.tensor(m, dtype=torch.float32, device=device),
    )


def filtered_distribution(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """The distribution a sampled row must follow, in float64 straight from the semantics of
    batonlm.kernels.sampling (independent of its code): softmax(logits / T), keep
    p >= max(k-th largest, top-p threshold within the top-k, min_p * max), renormalise."""
    z = [x / temperature for x in logits]
    zmax = max(z)
    e = [math.exp(v - zmax) for v in z]
    probs = [v / sum(e) for v in e]
    ordered = sorted(probs, reverse=True)
    k = len(probs) if top_k < 1 else min(top_k, len(probs))
    t_k = ordered[k - 1]
    mass_k = sum(v for v in probs if v >= t_k)
    t_p = 0.0
    if top_p < 1.0:
        acc = 0.0
        for v in ordered:
            acc += v
            if acc >= top_p * mass_k:
                t_p = v
                break
    threshold = max(t_k, t_p, min_p * ordered[0])
    kept = [v if v >= threshold and v > 0 else 0.0 for v in probs]
    return [v / sum(kept) for v in kept]


def chi_square(counts: torch.Tensor, expected_p: list[float]) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the tokens with expected mass."""
    n = float(counts.sum())
    stat, cells = 0.0, 0
    for c, p in zip(counts.tolist(), expected_p):
        if p > 0:
            stat += (c - n * p) ** 2 / (n * p)
            cells += 1
    return stat, cells - 1


def flat_penalties(fn):
    """`fn` (a penalties function) taking the PenaltyBatch fields as positional arguments:
    (logits, req_slots, counts, prompt_mask, freq, pres, rep, bias_ids, bias_values, banned)."""

    def call(logits, *fields_and_banned):
        *fields, banned = fields_and_banned
        return fn(logits, PenaltyBatch(*fields), banned)

    return call


def calibrated_input_scales(x: torch.Tensor, w13: torch.Tensor, qmax: float, seed: int,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Static activation scales of MoE experts (float32 [E] each, for the gate/up and the down
    projection), as a calibration over `x` would give, each times 0.5 to 1.5 drawn per expert:
    some experts' inputs saturate, others use part of the range. w13: the experts' float gate/up
    weights [E, 2I, H]."""
    g = torch.Generator().manual_seed(seed)
    experts = w13.shape[0]
    gate, up = (x.double() @ w13.double().transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I]
    inner = torch.nn.functional.silu(gate) * up
    spread = lambda: 0.5 + torch.rand(experts, generator=g, dtype=torch.float64)  # noqa: E731
    a13 = x.double().abs().max() / qmax * spread()
    a2 = inner.abs().amax(dim=(1, 2)) / qmax * spread()
    return a13.float(), a2.float()


def gated_with_error(x_d: torch.Tensor, w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's gated intermediate g = silu(gate) * up in float64 from its dequantized input row
    x_d [K] and gate/up weights w13 [2I, K], and a bound on how far float32's computation of it can
    be: each K-term product within (K + 4) eps of its magnitudes, through the gate (silu's slope
    is at most 1.1) and the product, plus a few roundings of g itself. A requantized element's
    code can differ from the float64 one only where [g - bound, g + bound] straddles a rounding
    boundary (tests take the codes at both ends)."""
    eps = torch.finfo(torch.float32).eps
    h = x_d @ w13.T
    err = (x_d.shape[0] + 4) * eps * (x_d.abs() @ w13.abs().T)
    gate, up = h.chunk(2)
    e_gate, e_up = err.chunk(2)
    silu = torch.nn.functional.silu(gate)
    g = silu * up
    bound = 1.1 * e_gate * (up.abs() + e_up) + (silu.abs() + 1.1 * e_gate) * e_up + 8 * eps * g.abs()
    return g, 2 * bound + torch.finfo(torch.float32).tiny


def static_experts_truth(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, a13: torch.Tensor, a2: torch.Tensor,
                         ids: torch.Tensor, weights: torch.Tensor, quantized) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bound) in float64 of W8A8 experts with static activation scales, from the dequantized
    weights w13 [E, 2I, H] and w2 [E, H, I] (float64) and `quantized(v, scale)`: a float32 row [1,
    K] quantized by a scale and dequantized, float64 [K] (the format's own quantizer). Each routed
    row is quantized by its expert's a13 (the same float32 codes the kernels take), its gated
    intermediate by the expert's a2. Computed in float32 an intermediate element's code may differ
    only where its rounding error straddles a code boundary (`gated_with_error`): that difference
    through |W2|, plus float32's roundings of the magnitudes. Tight: a wrong scale shows."""
    eps = torch.finfo(torch.float32).eps
    out = torch.zeros(x.shape, dtype=torch.float64)
    bound = torch.zeros(x.shape, dtype=torch.float64)
    depth = x.shape[1] + w2.shape[2] + ids.shape[1]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e, w = int(ids[t, slot]), float(weights[t, slot])
            g, err = gated_with_error(quantized(x[t : t + 1], a13[e]), w13[e])
            g_d = quantized(g.float()[None], a2[e])
            moved = quantized((g + err).float()[None], a2[e]) - quantized((g - err).float()[None], a2[e])
            out[t] += w * (g_d @ w2[e].T)
            bound[t] += w * (moved.abs() @ w2[e].abs().T + 4 * depth * eps * ((g.abs() + g_d.abs()) @ w2[e].abs().T))
    return out, bound
