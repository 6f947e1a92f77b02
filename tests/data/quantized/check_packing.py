"""Check tests/quant_formats.py's GPTQ / AWQ packing against the tools' own code (README.md here).

    AWQ_VENV/bin/python tests/data/quantized/check_packing.py autoawq     # AutoAWQ's packing_utils + WQLinear_GEMM
    GPTQ_VENV/bin/python tests/data/quantized/check_packing.py gptqmodel  # GPTQModel's PackableQuantLinear

For checkpoints written by the helper (several bits / groups / sym / desc_act, and the committed
gptq-w4g64 and awq-w4g64, which must also be byte-identical to a fresh write), the tool's
unpacking/dequantization must give exactly the helper's dequantized float32 weights, and the tool's
packer, given the helper's scales and zeros, must give the helper's qweight and qzeros bit for bit.
For the checkpoints GPTQModel wrote (gptqmodel-*), the helper's readers (dequantize_gptq /
dequantize_awq) must give exactly what the tool's code reads. Scales are handed to the tools'
dequantization in float32 (their own float16 multiply would round scale * (q - z)).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
import quant_formats as qf  # noqa: E402

SOURCE = HERE / "fp32-source"
checked = 0


def linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")})


def same_files(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def expect_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    global checked
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: max |diff| {(got.double() - want.double()).abs().max().item()}")
    checked += 1


# --------------------------------------------------------------------------------------------- AWQ


def check_autoawq() -> None:
    import awq
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm, reverse_awq_order, unpack_awq

    print("autoawq", awq.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        for G in (64, 128):
            out = Path(tmp) / f"awq-g{G}"
            deq = qf.write_awq_checkpoint(SOURCE, out, group_size=G)
            if G == 64:
                same_files(out, HERE / "awq-w4g64")
            t = load_file(str(out / "model.safetensors"))
            for p in linears(t):
                qw, qz, sc = t[p + ".qweight"], t[p + ".qzeros"], t[p + ".scales"]
                want = deq[p + ".weight"]  # [N, K]
                # 1. AutoAWQ's dequantization (unpack_awq + reverse_awq_order inside).
                expect_equal(f"{p} g{G} dequantize_gemm", dequantize_gemm(qw, qz, sc.float(), 4, G).T, want)
                # 2. its unpacking alone, as codes.
                iw, iz = unpack_awq(qw, qz, 4)
                iw, iz = reverse_awq_order(iw, iz, 4)
                iw, iz = iw & 15, iz & 15
                q = ((want / sc.float().repeat_interleave(G, 0).T).round() + iz.repeat_interleave(G, 0).T).to(torch.int8)
                expect_equal(f"{p} g{G} codes", iw.T.contiguous(), q)
                # 3. AutoAWQ's packer, from the fake-quantized weight and our scales / zeros.
                N, K = want.shape
                lin = torch.nn.Linear(K, N, bias=False)
                lin.weight.data = want.clone()
                zeros = iz.to(torch.float32)  # [K/G, N]
                packed = WQLinear_GEMM.from_linear(lin, 4, G, False, sc.float(), zeros)
                expect_equal(f"{p} g{G} WQLinear_GEMM.qweight", packed.qweight, qw)
                expect_equal(f"{p} g{G} WQLinear_GEMM.qzeros", packed.qzeros, qz)
    # GPTQModel's AWQ checkpoint, read by AutoAWQ and by the helper's reader.
    fx = HERE / "gptqmodel-awq-w4g64"
    t = load_file(str(fx / "model.safetensors"))
    for p in linears(t):
        qw, qz, sc = t[p + ".qweight"], t[p + ".qzeros"], t[p + ".scales"]
        expect_equal(f"{fx.name} {p}", qf.dequantize_awq(qw, qz, sc, 64), dequantize_gemm(qw, qz, sc.float(), 4, 64).T)


# -------------------------------------------------------------------------------------------- GPTQ


class _Cfg:
    def __init__(self, bits: int):
        self.bits, self.pack_dtype = bits, torch.int32


def check_gptqmodel() -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import gptqmodel
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module

    print("gptqmodel", gptqmodel.__version__)

    def module(bits, G, sym, desc_act, K, N):
        return TorchLinear(bits=bits, group_size=G, sym=sym, desc_act=desc_act, in_features=K, out_features=N, bias=False)

    def tool_dequant(t, p, bits, G, sym, desc_act):
        """GPTQModel's reading of a v1 checkpoint: load the tensors, convert v1 -> v2 zeros, and
        its reference (PackableQuantLinear) dequantization, with float32 scales."""
        K = t[p + ".g_idx"].numel()
        N = t[p + ".scales"].shape[1]
        m = module(bits, G, sym, desc_act, K, N)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            getattr(m, name).data = t[f"{p}.{name}"].clone()
        convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
        m.scales.data = m.scales.data.float()
        return PackableQuantLinear.dequantize_weight(m).T  # [N, K]

    cases = [
        (4, 64, True, False),
        (4, 128, False, True),
        (4, 64, False, False),
        (8, 64, True, False),
        (8, 128, False, True),
        (2, 64, True, True),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for bits, G, sym, desc_act in cases:
            tag = f"b{bits} g{G} sym={sym} desc_act={desc_act}"
            out = Path(tmp) / tag.replace(" ", "_")
            deq = qf.write_gptq_checkpoint(SOURCE, out, bits=bits, group_size=G, sym=sym, desc_act=desc_act)
            if (bits, G, sym, desc_act) == (4, 64, True, False):
                same_files(out, HERE / "gptq-w4g64")
            t = load_file(str(out / "model.safetensors"))
            for p in linears(t):
                want = deq[p + ".weight"]
                expect_equal(f"{p} {tag} dequantize_weight", tool_dequant(t, p, bits, G, sym, desc_act), want)
                # GPTQModel's packer (pack_original), from the fake-quantized weight, our scales,
                # zeros and g_idx, then its v2 -> v1 export conversion.
                N, K = want.shape
                g_idx = t[p + ".g_idx"]
                scales = t[p + ".scales"].float()  # [K/G, N]
                zeros = qf.unpack_cols(qf._to_int32(t[p + ".qzeros"].to(torch.int64) + qf._ones_pattern(bits)), bits)
                lin = torch.nn.Linear(K, N, bias=False)
                lin.weight.data = want.clone()
                m = module(bits, G, sym, desc_act, K, N)
                m.pack_original(lin, scales.T.contiguous(), zeros.T.contiguous().to(torch.float32), g_idx=g_idx.clone())
                expect_equal(f"{p} {tag} pack_original.qweight", m.qweight.data.to(torch.int32), t[p + ".qweight"])
                convert_gptq_v2_to_v1_format_module(m, _Cfg(bits))
                expect_equal(f"{p} {tag} pack_original.qzeros(v1)", m.qzeros.data.to(torch.int32), t[p + ".qzeros"])
    # GPTQModel's own checkpoints, read by GPTQModel and by the helper's reader.
    for name, sym, desc_act in (("gptqmodel-w4g64", True, False), ("gptqmodel-w4g64-asym-descact", False, True)):
        t = load_file(str(HERE / name / "model.safetensors"))
        for p in linears(t):
            expect_equal(
                f"{name} {p}",
                qf.dequantize_gptq(t[p + ".qweight"], t[p + ".qzeros"], t[p + ".scales"], t[p + ".g_idx"], 4),
                tool_dequant(t, p, 4, 64, sym, desc_act),
            )


if __name__ == "__main__":
    {"autoawq": check_autoawq, "gptqmodel": check_gptqmodel}[sys.argv[1]]()
    print(f"OK: {checked} exact comparisons")
