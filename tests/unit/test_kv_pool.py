"""The KV pool in FP8 (`--kv-cache-dtype`): what a write stores and a gather gives back (the
format's rounding, the layer's scales, saturation instead of inf/NaN), the checkpoint's scales,
and the capacity the same memory holds."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import save_file

from batonlm.model_runner.kv_pool import KV_CACHE_DTYPES, KVPool, kv_cache_dtype
from batonlm.model_runner.kv_scales import read_kv_scales
from batonlm.model_runner.weight_loader import WeightLoadError

# (mantissa bits, the smallest normal exponent): round-to-nearest's relative error on normal
# values is at most 2^-(mantissa + 1); below 2^emin the spacing is 2^(emin - mantissa), so the
# absolute error is at most half of that.
FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
F32 = 2.0**-24


def _pool(cache_dtype, k_scales=None, v_scales=None, layers=2) -> KVPool:
    return KVPool(64, layers, 3, 5, torch.float32, "cpu", cache_dtype, k_scales, v_scales)


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_write_then_gather_rounds_once_within_the_format(cache_dtype):
    mantissa, emin = FORMATS[cache_dtype]
    k_scales, v_scales = [0.37, 1.0], [2.5, 0.011]
    pool = _pool(cache_dtype, k_scales, v_scales)
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([5, 1, 17, 63, 30, 2, 9])  # odd count, out of order
    for layer in range(2):
        # Magnitudes from far below the subnormals to the format's top, times the scale.
        k = torch.randn(7, 3, 5, generator=g) * torch.logspace(-6, 2, 5)
        v = torch.randn(7, 3, 5, generator=g) * torch.logspace(-6, 2, 5)
        pool.write(layer, slots, k, v)
        got_k, got_v = pool.gather(layer, slots)
        assert got_k.dtype == got_v.dtype == torch.float32 and got_k.shape == (3, 7, 5)
        assert pool.k[layer].dtype == cache_dtype
        for got, x, s in ((got_k, k.transpose(0, 1), k_scales[layer]), (got_v, v.transpose(0, 1), v_scales[layer])):
            # Exactly the one rounding: x / s to the format, back times s.
            m = torch.finfo(cache_dtype).max
            assert torch.equal(got, (x / s).clamp(-m, m).to(cache_dtype).float() * s)
            # Within the format's rounding (plus the float32 quotient and product, a unit each).
            inside = x.abs() <= m * s
            tol = (2.0 ** -(mantissa + 1) + 4 * F32) * x.abs() + s * 2.0 ** (emin - mantissa - 1)
            assert bool(((got - x).abs() <= tol)[inside].all())
        # Into reused buffers: the same values.
        bufs = pool.gather_buffers(7)
        assert all(torch.equal(a, b) for a, b in zip(pool.gather(layer, slots, bufs), (got_k, got_v)))


@pytest.mark.parametrize("cache_dtype", list(FORMATS))
def test_values_beyond_the_format_saturate(cache_dtype):
    """Keys past the largest finite value times the scale become that value, never inf or NaN
    (e5m2 would round them to inf)."""
    pool = _pool(cache_dtype, [0.5, 0.5], [2.0, 2.0])
    m = torch.finfo(cache_dtype).max
    k = torch.tensor([1e30, -1e30, 3 * m, 0.0, -0.0, 1e-30]).reshape(6, 1, 1).expand(6, 3, 5).contiguous()
    slots = torch.arange(1, 7)
    pool.write(0, slots, k, k)
    got_k, got_v = pool.gather(0, slots)
    assert bool(torch.isfinite(got_k).all()) and bool(torch.isfinite(got_v).all())
    assert got_k[0, :, 0].tolist() == [m * 0.5, -m * 0.5, m * 0.5, 0.0, 0.0, 0.0]
    assert got_v[0, :, 0].tolist() == [m * 2.0, -m * 2.0, m * 2.0, 0.0, 0.0, 0.0]


def test_kv_cache_dtype_names_and_bad_scales():
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    with pytest.raises(ValueError, match="'int8' is not supported"):
        kv_cache_dtype("int8", torch.float32)
    with pytest.raises(ValueError, match="k_scale of layer 1 is 0.0"):
        _pool(torch.float8_e4m3fn, [1.0, 0.0])
    with pytest.raises(ValueError, match="v_scale of layer 0 is nan"):
        _pool(torch.float8_e4m3fn, None, [math.nan, 1.0])
    with pytest.raises(ValueError, match="3 k_scale values for 2 layers"):
        _pool(torch.float8_e4m3fn, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="apply to an FP8 KV cache"):
        _pool(torch.float32, [1.0, 1.0])


def test_bytes_per_token_halves_bfloat16s():
    per = {name: KVPool.bytes_per_token(5, 4, 8, dt) for name, dt in KV_CACHE_DTYPES.items()}
    assert per == {"fp8_e4m3": 320, "fp8_e5m2": 320}  # 2 (K, V) x 5 layers x 4 heads x 8 dims, a byte each
    assert KVPool.bytes_per_token(5, 4, 8, torch.bfloat16) == 640
    assert KVPool.bytes_per_token(5, 4, 8, torch.float32) == 1280


def _checkpoint(path, tensors: dict[str, torch.Tensor]) -> str:
    path.mkdir(exist_ok=True)
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2), **tensors}, str(path / "model.safetensors"))
    return str(path)


def test_scales_from_the_checkpoint(tmp_path):
    """vLLM / llm-compressor names: a layer's k_scale and v_scale, or its one kv_scale for both;
    1.0 (and named as missing) where there is none."""
    one = torch.tensor(0.25)
    path = _checkpoint(tmp_path / "a", {
        "model.layers.0.self_attn.k_scale": one, "model.layers.0.self_attn.v_scale": torch.tensor([3.0]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.5),
        "model.layers.1.self_attn.v_scale": torch.tensor(0.125),  # its own before kv_scale
    })
    scales = read_kv_scales(path, 3)
    assert scales.k == (0.25, 0.5, 1.0) and scales.v == (3.0, 0.125, 1.0)
    assert scales.missing == ("k_scale of layer 2", "v_scale of layer 2")
    none = read_kv_scales(_checkpoint(tmp_path / "b", {}), 2)
    assert none.k == none.v == (1.0, 1.0) and len(none.missing) == 4


def test_every_exporters_scale_names(tmp_path):
    """Older compressed-tensors and Quark checkpoints name the scales as k_proj's / v_proj's
    output scales, ModelOpt as the projections' k_scale / v_scale, a fused qkv_proj (Phi-3) as
    its own; a query scale (attention over FP8 queries, not run) is passed over by the loader."""
    from batonlm.model_runner.weight_loader import _IGNORED_SUFFIXES

    path = _checkpoint(tmp_path, {
        "model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.25),
        "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(2.0),
        "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(4.0),
        "model.layers.2.self_attn.qkv_proj.k_scale": torch.tensor(0.125),
        "model.layers.2.self_attn.qkv_proj.v_scale": torch.tensor(8.0),
    })
    scales = read_kv_scales(path, 3)
    assert scales.k == (0.5, 2.0, 0.125) and scales.v == (0.25, 4.0, 8.0) and not scales.missing
    assert "model.layers.0.self_attn.q_proj.output_scale".endswith(_IGNORED_SUFFIXES)


@pytest.mark.parametrize("name, value, message", [
    ("model.layers.0.self_attn.k_scale", torch.tensor([1.0, 2.0]), "one number, this has shape"),
    ("model.layers.0.self_attn.v_scale", torch.tensor(-1.0), "must be positive and finite"),
    ("model.layers.7.self_attn.k_scale", torch.tensor(1.0), "no layer of the model's 2"),
])
def test_bad_checkpoint_scales_are_named(tmp_path, name, value, message):
    with pytest.raises(WeightLoadError, match=message) as e:
        read_kv_scales(_checkpoint(tmp_path, {name: value}), 2)
    assert name in str(e.value)


def test_the_weight_loader_accepts_the_scale_tensors(tmp_path, stories_path):
    """A checkpoint with KV scales loads (strict loading passes over them: they are the pool's),
    whatever the KV cache dtype; unknown tensors stay errors."""
    import shutil

    from safetensors.torch import load_file

    from batonlm.model_runner.model_config import ModelConfig
    from batonlm.model_runner.model_loader import load_model

    model_dir = tmp_path / "scaled"
    shutil.copytree(stories_path, model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(weights, str(model_dir / "model.safetensors"))
    load_model(ModelConfig.from_hf(model_dir), torch.float32, "cpu")
    weights["model.layers.0.self_attn.q_scale"] = torch.tensor(0.5)  # a query scale: passed over
    save_file(weights, str(model_dir / "model.safetensors"))
    load_model(ModelConfig.from_hf(model_dir), torch.float32, "cpu")
    weights["model.layers.0.self_attn.z_scale"] = torch.tensor(0.5)
    save_file(weights, str(model_dir / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="1 unexpected tensor"):
        load_model(ModelConfig.from_hf(model_dir), torch.float32, "cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_same_memory_holds_twice_bfloat16s_tokens_in_fp8(monkeypatch, stories_path, device):
    """The capacity sizing (`device_spec`'s): at one KV budget an FP8 cache holds twice the
    tokens of a bfloat16 one and four times a float32 one (floor(2x) // 2 == floor(x)). The
    request ceiling is lifted so that memory binds; on CUDA the free memory is fixed."""
    from batonlm.config import ServerArgs
    from batonlm.device import spec
    from batonlm.model_runner.model_config import ModelConfig

    cfg = ModelConfig.from_hf(stories_path)
    if device == "cuda":
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _device: (3 * 2**30, 4 * 2**30))
    args = ServerArgs(model=stories_path, max_running_requests=1 << 20)

    def capacity(dtype: torch.dtype, kv: str) -> int:
        return spec._kv_capacity(args.replace(kv_cache_dtype=kv), cfg, dtype, device, cfg.context_length)

    bf16, fp32 = capacity(torch.bfloat16, "auto"), capacity(torch.float32, "auto")
    for kv in KV_CACHE_DTYPES:
        assert capacity(torch.bfloat16, kv) // 2 == bf16 and capacity(torch.float32, kv) // 4 == fp32
        if device == "cpu":  # 2 GiB of 320-byte tokens
            assert capacity(torch.bfloat16, kv) == spec.CPU_KV_BUDGET_BYTES // 320 == 6710886
    if device == "cpu":  # the engine's own sizing, through device_spec
        got = spec.device_spec(args.replace(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"), cfg)
        assert (got.kv_capacity, got.kv_cache_dtype) == (2 * bf16, "fp8_e4m3")


def test_the_flag_takes_its_choices_only(capsys):
    from batonlm.cli import parse_serve_args
    from batonlm.config import KV_CACHE_DTYPE_CHOICES, ConfigError, ServerArgs

    assert KV_CACHE_DTYPE_CHOICES == ("auto", *KV_CACHE_DTYPES)  # the pool's formats, all offered
    assert parse_serve_args(["--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    assert ServerArgs().kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype: must be one of auto, fp8_e4m3, fp8_e5m2"):
        ServerArgs(kv_cache_dtype="fp8")
    with pytest.raises(SystemExit):
        parse_serve_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="resident memory read from /proc")
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_a_cpu_pool_is_zeros_committed_only_where_written(cache_dtype):
    """512 MiB of pool (fp32; 128 MiB in FP8) adds next to nothing to the process's resident memory
    until slots are written: an idle server does not hold its whole KV budget."""
    before = _resident_bytes()
    pool = KVPool(1 << 16, 8, 4, 64, torch.float32, "cpu", cache_dtype)
    size = sum(t.numel() * t.element_size() for t in pool.k + pool.v)
    assert size >= 128 << 20
    assert _resident_bytes() - before < size // 8
    assert all(not t.view(torch.uint8).any() for t in pool.k + pool.v)  # zeros (read through the zero page)
    k, v = torch.randn(3, 4, 64), torch.randn(3, 4, 64)
    pool.write(0, torch.tensor([5, 6, 7]), k, v)
    keys, _ = pool.gather(0, torch.tensor([5, 6, 7, 8]))
    assert keys[:, 3].abs().sum() == 0 and keys[:, :3].abs().sum() > 0
