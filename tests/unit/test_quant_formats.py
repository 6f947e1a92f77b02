"""tests/quant_formats.py (the GPTQ / AWQ checkpoint writer for loader tests) against an unpacking
written here from the formats' descriptions, independently of the helper's own readers: numpy
uint32 words, one code at a time. (check_packing.py in tests/data/quantized checks the same packing
against AutoAWQ's and GPTQModel's code, in their venvs.) At the end, tests/quant_w8a8.py against
the W8A8 int8 and FP8 checkpoints llm-compressor wrote, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import quant_formats as qf
import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "quantized"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds output column AWQ_ORDER[i]


def codes_along_rows(words: torch.Tensor, bits: int) -> np.ndarray:
    """GPTQ qweight [K/f, N] -> [K, N]: input row i*f + j is bits [bits*j, bits*j+bits) of word i."""
    w = words.numpy().view(np.uint32)
    f = 32 // bits
    out = np.zeros((w.shape[0] * f, w.shape[1]), dtype=np.int64)
    for j in range(f):
        out[j::f] = (w >> np.uint32(bits * j)) & np.uint32(2**bits - 1)
    return out


def codes_along_cols(words: torch.Tensor, bits: int, order: list[int] | None = None) -> np.ndarray:
    """[R, C/f] -> [R, C]: slot j of word c is column c*f + order[j] (identity when no order)."""
    w = words.numpy().view(np.uint32)
    f = 32 // bits
    order = order or list(range(f))
    out = np.zeros((w.shape[0], w.shape[1] * f), dtype=np.int64)
    for j in range(f):
        out[:, order[j] :: f] = (w >> np.uint32(bits * j)) & np.uint32(2**bits - 1)
    return out


def gptq_meaning(t: dict, p: str, bits: int) -> np.ndarray:
    """W [N, K] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]), v1 zeros: the stored word
    plus one in every code (GPTQModel's v1 -> v2 conversion), float32."""
    q = codes_along_rows(t[p + ".qweight"], bits)  # [K, N]
    ones = sum(1 << (bits * j) for j in range(32 // bits))
    zw = (t[p + ".qzeros"].numpy().view(np.uint32).astype(np.uint64) + ones) % 2**32
    z = codes_along_cols(torch.from_numpy(zw.astype(np.uint32).view(np.int32)), bits)  # [K/G, N]
    s = t[p + ".scales"].float().numpy()
    g = t[p + ".g_idx"].numpy().astype(np.int64)
    return (s[g] * (q - z[g]).astype(np.float32)).T


def awq_meaning(t: dict, p: str, group: int) -> np.ndarray:
    q = codes_along_cols(t[p + ".qweight"], 4, AWQ_ORDER)  # [K, N]
    z = codes_along_cols(t[p + ".qzeros"], 4, AWQ_ORDER)  # [K/G, N]
    s = t[p + ".scales"].float().numpy()
    g = np.arange(q.shape[0]) // group
    return (s[g] * (q - z[g]).astype(np.float32)).T


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory) -> Path:
    """A small float checkpoint with decoder-linear names of awkward-but-legal shapes, an embedding,
    a norm and an lm_head (which must pass through unquantized)."""
    d = tmp_path_factory.mktemp("float_ckpt")
    g = torch.Generator().manual_seed(7)
    t = {
        "model.embed_tokens.weight": torch.randn(40, 64, generator=g),
        "model.layers.0.input_layernorm.weight": torch.rand(64, generator=g) + 0.5,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 256, generator=g) * 0.2,
        "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 128, generator=g) * 0.05,
        "model.layers.0.mlp.down_proj.weight": torch.randn(96, 384, generator=g) * 3.0,
        "lm_head.weight": torch.randn(40, 64, generator=g),
    }
    t["model.layers.0.mlp.down_proj.weight"][:, :128] += 1.0  # groups far from zero-centred
    save_file(t, str(d / "model.safetensors"))
    # a fixture directory's reference logits are not part of the checkpoint
    save_file({"logits": torch.zeros(2, 40)}, str(d / "reference.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32"}))
    return d


QUANTIZED = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize(
    "bits,group,sym,desc_act",
    [(4, 128, True, False), (4, 64, False, True), (8, 32, True, True), (8, 128, False, False), (2, 64, True, False)],
)
def test_gptq_layout_and_meaning(float_ckpt, tmp_path, bits, group, sym, desc_act):
    deq = qf.write_gptq_checkpoint(float_ckpt, tmp_path, bits=bits, group_size=group, sym=sym, desc_act=desc_act)
    t = load_file(str(tmp_path / "model.safetensors"))
    src = load_file(str(float_ckpt / "model.safetensors"))
    assert len(t) == 3 + 4 * len(QUANTIZED)
    f = 32 // bits
    for p in QUANTIZED:
        N, K = src[p + ".weight"].shape
        assert p + ".weight" not in t
        assert (t[p + ".qweight"].dtype, tuple(t[p + ".qweight"].shape)) == (torch.int32, (K // f, N))
        assert (t[p + ".qzeros"].dtype, tuple(t[p + ".qzeros"].shape)) == (torch.int32, (K // group, N // f))
        assert (t[p + ".scales"].dtype, tuple(t[p + ".scales"].shape)) == (torch.float16, (K // group, N))
        assert (t[p + ".g_idx"].dtype, tuple(t[p + ".g_idx"].shape)) == (torch.int32, (K,))
        g_idx = t[p + ".g_idx"]
        # every group holds exactly `group` input rows; in order unless desc_act
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((K // group,), group))
        assert torch.equal(g_idx, torch.arange(K, dtype=torch.int32) // group) != desc_act
        meaning = gptq_meaning(t, p, bits)
        np.testing.assert_array_equal(meaning, deq[p + ".weight"].numpy())
        # round to nearest: within one step of the source (the top code clamps, so not half)
        step = t[p + ".scales"].float()[g_idx.long()].T
        assert bool(((deq[p + ".weight"] - src[p + ".weight"]).abs() <= step * 1.0001).all())
        if sym:
            zeros = codes_along_cols(t[p + ".qzeros"], bits)
            assert (zeros == 2 ** (bits - 1) - 1).all()  # v1: 8 - 1 for 4 bits
    for k in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"):
        assert t[k].dtype == torch.bfloat16 and torch.equal(t[k], src[k].to(torch.bfloat16))
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")} == {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": "gptq",
    }


@pytest.mark.parametrize("group", [32, 128])
def test_awq_layout_and_meaning(float_ckpt, tmp_path, group):
    deq = qf.write_awq_checkpoint(float_ckpt, tmp_path, group_size=group)
    t = load_file(str(tmp_path / "model.safetensors"))
    src = load_file(str(float_ckpt / "model.safetensors"))
    assert len(t) == 3 + 3 * len(QUANTIZED)
    for p in QUANTIZED:
        N, K = src[p + ".weight"].shape
        assert (t[p + ".qweight"].dtype, tuple(t[p + ".qweight"].shape)) == (torch.int32, (K, N // 8))
        assert (t[p + ".qzeros"].dtype, tuple(t[p + ".qzeros"].shape)) == (torch.int32, (K // group, N // 8))
        assert (t[p + ".scales"].dtype, tuple(t[p + ".scales"].shape)) == (torch.float16, (K // group, N))
        assert p + ".g_idx" not in t
        np.testing.assert_array_equal(awq_meaning(t, p, group), deq[p + ".weight"].numpy())
        # the rounded zero shifts the grid by up to half a step, the clamp at 0 / 15 by another half
        step = t[p + ".scales"].float().repeat_interleave(group, 0).T
        assert bool(((deq[p + ".weight"] - src[p + ".weight"]).abs() <= step * 1.0001).all())
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc == {
        "bits": 4,
        "group_size": group,
        "modules_to_not_convert": None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    }


def test_packing_orders_by_hand():
    # GPTQ qweight: input rows 0..7 of one output column -> nibbles 0..7 of one word.
    q = torch.arange(8).reshape(8, 1)
    assert qf.pack_rows(q, 4).item() == 0x76543210
    # AWQ: output columns 0..7 of one input row -> nibbles in the order 0 2 4 6 1 3 5 7.
    assert qf.pack_cols(torch.arange(8).reshape(1, 8), 4, qf.AWQ_ORDER).item() == 0x75316420
    # A word with the top bit set is stored as the negative int32 with the same bits.
    assert qf.pack_rows(torch.full((8, 1), 15), 4).item() == -1
    # GPTQ v1 zeros: 8 everywhere (sym) -> 7 in every nibble.
    assert qf.gptq_v1_qzeros(torch.full((1, 8), 8), 4).item() == 0x77777777
    # A zero of 0 borrows from the next code (GPTQModel's whole-word minus 0x11111111), and the
    # reader's whole-word plus undoes it.
    z = torch.tensor([[0, 5, 1, 2, 3, 4, 6, 7]])
    word = qf.gptq_v1_qzeros(z, 4)
    assert (word.item() & 0xFFFFFFFF) == (0x76432150 - 0x11111111) & 0xFFFFFFFF
    assert torch.equal(qf.unpack_cols(qf._to_int32(word.to(torch.int64) + 0x11111111), 4), z)


def test_readers_agree_with_spec_on_committed_fixtures():
    """The helper's readers against the independent ones, on the checkpoints GPTQModel wrote (so a
    loader test may use either as its reference), and the helper-written fixtures still decode to
    their source within one quantization step."""
    src = load_file(str(FIXTURES / "fp32-source" / "model.safetensors"))
    for name in ("gptqmodel-w4g64", "gptqmodel-w4g64-asym-descact", "gptq-w4g64"):
        t = load_file(str(FIXTURES / name / "model.safetensors"))
        layers = sorted({k[: -len(".qweight")] for k in t if k.endswith(".qweight")})
        assert len(layers) == 14
        for p in layers:
            ours = qf.dequantize_gptq(t[p + ".qweight"], t[p + ".qzeros"], t[p + ".scales"], t[p + ".g_idx"], 4)
            np.testing.assert_array_equal(ours.numpy(), gptq_meaning(t, p, 4))
            if name == "gptq-w4g64":
                step = t[p + ".scales"].float()[t[p + ".g_idx"].long()].T
                assert bool(((ours - src[p + ".weight"]).abs() <= step * 1.0001).all())
    for name in ("gptqmodel-awq-w4g64", "awq-w4g64"):
        t = load_file(str(FIXTURES / name / "model.safetensors"))
        for p in sorted({k[: -len(".qweight")] for k in t if k.endswith(".qweight")}):
            ours = qf.dequantize_awq(t[p + ".qweight"], t[p + ".qzeros"], t[p + ".scales"], 64)
            np.testing.assert_array_equal(ours.numpy(), awq_meaning(t, p, 64))


@pytest.mark.parametrize("kind, fixture", [("int", "w8a8"), ("float", "fp8-dynamic"), ("int", "w8a8-asym")])
def test_the_w8a8_writer_is_llm_compressors_bytes(tmp_path, kind, fixture):
    """tests/quant_w8a8.py on the fixtures' source model writes llm-compressor's W8A8 (with
    symmetric or asymmetric activations) and FP8_DYNAMIC fixtures: the same codes and bfloat16
    scales, tensor for tensor, and a config loading the same."""
    from quant_w8a8 import write_w8a8_checkpoint

    from batonlm.model_runner.model_config import ModelConfig

    out = tmp_path / fixture
    deq = write_w8a8_checkpoint(FIXTURES / "fp32-source", out, kind=kind, asym_activations=fixture.endswith("asym"))
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(FIXTURES / fixture / "model.safetensors"))
    assert ours.keys() == theirs.keys() and len(deq) == 14
    for name, t in theirs.items():
        got = ours[name]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                                                    t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t), name
    assert ModelConfig.from_hf(out).quantization == ModelConfig.from_hf(FIXTURES / fixture).quantization


def test_the_nf4_writer_is_bitsandbytes_codes_and_scales(tmp_path):
    """tests/quant_bnb.py on the fixtures' source model: bitsandbytes' own NF4 codes (the
    `bnb-nf4` fixture, written by transformers + bitsandbytes; its scales are double-quantized
    after the codes are chosen) byte for byte, and its float32 scales (those of `bnb-fp4`, which
    keeps them: a block's absmax does not depend on the table), the NF4 table bitsandbytes
    stores, and a config loading as bitsandbytes 4-bit."""
    from quant_bnb import NF4, write_bnb4_checkpoint

    from batonlm.model_runner.model_config import ModelConfig

    out = tmp_path / "nf4"
    deq = write_bnb4_checkpoint(FIXTURES / "fp32-source", out)
    ours = load_file(str(out / "model.safetensors"))
    nf4, fp4 = (load_file(str(FIXTURES / n / "model.safetensors")) for n in ("bnb-nf4", "bnb-fp4"))
    assert len(deq) == 14
    for name in deq:
        assert torch.equal(ours[name], nf4[name]), name
        assert torch.equal(ours[name + ".absmax"], fp4[name + ".absmax"]), name
        assert torch.equal(ours[name + ".quant_map"], nf4[name + ".quant_map"])
    assert torch.equal(torch.tensor(NF4), nf4["model.layers.0.mlp.down_proj.weight.quant_map"])
    quant = ModelConfig.from_hf(out).quantization
    assert quant is not None and quant.method == "bitsandbytes"


def test_the_8_bit_writer_is_bitsandbytes_bytes(tmp_path):
    """tests/quant_bnb.py's LLM.int8 writer on the fixtures' source model: the `bnb-int8` fixture
    (transformers + bitsandbytes) tensor for tensor, and a config loading the same."""
    from quant_bnb import write_int8_checkpoint

    from batonlm.model_runner.model_config import ModelConfig

    out = tmp_path / "int8"
    deq = write_int8_checkpoint(FIXTURES / "fp32-source", out)
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(FIXTURES / "bnb-int8" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and len(deq) == 14
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert ModelConfig.from_hf(out).quantization == ModelConfig.from_hf(FIXTURES / "bnb-int8").quantization


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_fp4_writers_round_trip(tmp_path, fmt):
    """tests/quant_nvfp4.py: batonlm reads back the dequantized weights a writer returns, bit for
    bit, each within one step of its group (E2M1's widest gap, 4 to 6, is 2 steps: half of it;
    NVFP4's FP8 scale rounds by 2^-4 more; MXFP4's power of two puts amax / step in (3, 6]) of the
    float weight."""
    from quant_nvfp4 import write_mxfp4_checkpoint, write_nvfp4_checkpoint

    from batonlm.model_runner.model_config import ModelConfig
    from batonlm.model_runner.quantization.dequantized import DequantizedCheckpoint
    from batonlm.model_runner.weight_loader import checkpoint_files

    out = tmp_path / fmt
    deq = (write_nvfp4_checkpoint if fmt == "nvfp4" else write_mxfp4_checkpoint)(FIXTURES / "fp32-source", out)
    src = load_file(str(FIXTURES / "fp32-source" / "model.safetensors"))
    quant = ModelConfig.from_hf(out).quantization
    assert quant is not None and quant.description == f"compressed-tensors ({fmt.upper()} weights)"
    group = 16 if fmt == "nvfp4" else 32
    with DequantizedCheckpoint(checkpoint_files(out), quant) as ckpt:
        assert len(ckpt.linears) == 14
        for name, w in deq.items():
            assert torch.equal(ckpt.read(name), w), name
            n, k = w.shape
            amax = src[name].float().view(n, k // group, group).abs().amax(dim=2, keepdim=True)
            err = (w - src[name].float()).view(n, k // group, group).abs()
            step = amax / 6 * (1 + 2.0**-4) if fmt == "nvfp4" else amax / 3  # MXFP4: 2^e < amax / 3 at most
            assert bool((err <= step + 1e-12).all()), name


def test_the_modelopt_nvfp4_writer_is_modelopts_export(tmp_path):
    """tests/quant_nvfp4.py's ModelOpt layout against ModelOpt 0.47's own export of the same weights
    (the `modelopt-w4a16-nvfp4` fixture): every quantized tensor byte for byte, the float ones the
    same values (the fixture keeps them in bfloat16), the same config; batonlm reads back the
    dequantized weights it returns bit for bit."""
    from quant_nvfp4 import write_modelopt_nvfp4_checkpoint

    from batonlm.model_runner.model_config import ModelConfig
    from batonlm.model_runner.quantization.dequantized import DequantizedCheckpoint
    from batonlm.model_runner.weight_loader import checkpoint_files

    out = tmp_path / "modelopt"
    deq = write_modelopt_nvfp4_checkpoint(FIXTURES / "fp32-source", out)
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(FIXTURES / "modelopt-w4a16-nvfp4" / "model.safetensors"))
    assert ours.keys() == theirs.keys() and len(deq) == 14
    for name, t in theirs.items():
        if t.dtype == torch.bfloat16:
            assert torch.equal(ours[name], t.float()), name
        else:
            same = torch.equal(ours[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
            assert ours[name].dtype == t.dtype and ours[name].shape == t.shape and same, name
    quant = ModelConfig.from_hf(out).quantization
    assert quant is not None and quant == ModelConfig.from_hf(FIXTURES / "modelopt-w4a16-nvfp4").quantization
    with DequantizedCheckpoint(checkpoint_files(out), quant) as ckpt:
        assert all(torch.equal(ckpt.read(name), w) for name, w in deq.items())


@pytest.mark.parametrize("fixture", ["mxfp8", "mxfp8a16"])
def test_the_mxfp8_writer_is_llm_compressors_bytes(tmp_path, fixture):
    """tests/quant_mxfp8.py on the fixtures' source writes llm-compressor's MXFP8 / MXFP8A16 codes
    and E8M0 exponents byte for byte, and a config loading the same (the float tensors stay in the
    source's float32 here; the fixture holds them in bfloat16)."""
    from quant_mxfp8 import write_mxfp8_checkpoint

    from batonlm.model_runner.model_config import ModelConfig

    out = tmp_path / fixture
    deq = write_mxfp8_checkpoint(FIXTURES / "fp32-source", out, activations=fixture == "mxfp8")
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(FIXTURES / fixture / "model.safetensors"))
    quantized = [n for n in theirs if n.endswith((".weight_scale",)) or theirs[n].dtype == torch.float8_e4m3fn]
    assert len(quantized) == 28 and len(deq) == 14 and ours.keys() == theirs.keys()
    for name in quantized:
        got, want = ours[name], theirs[name]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert ModelConfig.from_hf(out).quantization == ModelConfig.from_hf(FIXTURES / fixture).quantization


def test_the_fp8_pb_wo_writer_is_modelopts_export(tmp_path):
    """tests/quant_mxfp8.py's ModelOpt FP8_PB_WO writer on the source: ModelOpt 0.47's exported
    codes and [N / 128, 1, K / 128, 1] float32 block scales byte for byte, loading as the same."""
    from quant_mxfp8 import write_modelopt_fp8_pb_wo_checkpoint

    from batonlm.model_runner.model_config import ModelConfig

    out = tmp_path / "pb-wo"
    write_modelopt_fp8_pb_wo_checkpoint(FIXTURES / "fp32-source", out)
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(FIXTURES / "modelopt-fp8-pb-wo" / "model.safetensors"))
    quantized = [n for n in theirs if n.endswith(".weight_scale") or theirs[n].dtype == torch.float8_e4m3fn]
    assert len(quantized) == 28 and ours.keys() == theirs.keys()
    for name in quantized:
        got, want = ours[name], theirs[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want), name
    assert ModelConfig.from_hf(out).quantization == ModelConfig.from_hf(FIXTURES / "modelopt-fp8-pb-wo").quantization
