"""The graph-backed decode steps, short of compiling or capturing: their batch sizes, and the
batches they run (CompiledDecode's masked gather, CudaGraphDecode's padded static buffers) give
the eager step's logits — in float64, where a wrong key in or out of a mask would show at 1e-2
and rounding stays below 1e-9 — and padding rows write nowhere but the padding slot; with an FP8
KV pool too (both read the same stored values through the pool's scales)."""

from __future__ import annotations

import pytest
import torch
from helpers import family_with

from batonlm.model_runner.compiled_decode import CompiledDecode, batch_ranges, context_width
from batonlm.model_runner.cuda_graph_decode import CudaGraphDecode
from batonlm.model_runner.decode_graphs import COMPILE_MAX_BS, batch_buckets, smallest_bucket
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.model_runner import ModelRunner

CONTEXT = 256


def test_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(5) == (1, 2, 4, 5) and batch_buckets(1) == (1,)
    assert batch_buckets(40, step=8) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert batch_buckets(20, step=8) == (1, 2, 4, 8, 16, 20)
    assert [context_width(n, 512) for n in (1, 32, 33, 129, 500, 512)] == [32, 32, 64, 160, 512, 512]
    assert context_width(100, 100) == 100
    assert [smallest_bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceeds"):
        smallest_bucket(9, (1, 2, 4, 8))
    # The compiled step's graphs: the same ranges whatever the largest batch (a cache serves every
    # --max-running-requests), only those it reaches.
    assert batch_ranges(COMPILE_MAX_BS) == batch_ranges(2) == ((1, 1), (2, COMPILE_MAX_BS))
    assert batch_ranges(1) == ((1, 1),)


def _runner(path: str, dtype: torch.dtype, backend: str, kv_cache: str = "auto") -> ModelRunner:
    cfg = ModelConfig.from_hf(path)
    runner = ModelRunner(cfg, dtype=dtype, device="cpu", kv_capacity=1024, num_req_slots=8,
                         context_length=CONTEXT, attention_backend=backend, sampler="torch", kv_cache=kv_cache)
    if kv_cache != "auto":  # the tiny models have no KV scales: give each layer its own
        pool = runner.kv_pool
        pool.k_scale = [0.37 + 0.1 * i for i in range(cfg.num_layers)]
        pool.v_scale = [2.5 - 0.3 * i for i in range(cfg.num_layers)]
    runner.model.to(dtype)
    return runner


def _decode_batch(runner: ModelRunner, lengths: list[int]) -> ForwardBatch:
    """Prefill requests of `lengths` tokens (eagerly) into slots 1.., and return the batch of
    their next decode step (rows in request slots 1, 3, 5, ...)."""
    gen = torch.Generator().manual_seed(0)
    req_slots = [1 + 2 * i for i in range(len(lengths))]
    starts, next_free = [], 1
    for n in lengths:
        starts.append(next_free)
        next_free += n + 1  # room for the decode token
    ids = torch.randint(3, runner.cfg.vocab_size, (sum(lengths),), generator=gen)
    loc = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    runner.forward(ForwardBatch.build(loc, req_slots, [0] * len(lengths), lengths, "cpu", input_ids=ids))
    decode_loc = torch.tensor([s + n for s, n in zip(starts, lengths)])
    decode_ids = torch.randint(3, runner.cfg.vocab_size, (len(lengths),), generator=gen)
    return ForwardBatch.build(decode_loc, req_slots, lengths, [1] * len(lengths), "cpu", input_ids=decode_ids)


def _pool_copy(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for t in runner.kv_pool.k + runner.kv_pool.v]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An FP8 pool compared by its bytes."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_only_written(before, runner, slots: torch.Tensor) -> None:
    keep = torch.ones(before[0].shape[1], dtype=torch.bool)
    keep[0] = False  # the padding slot
    keep[slots] = False
    for old, new in zip(before, runner.kv_pool.k + runner.kv_pool.v):
        assert torch.equal(_bits(old)[:, keep], _bits(new)[:, keep]), "a padding row wrote past the padding slot"


@pytest.mark.parametrize("family, kv_cache", [(family_with("sliding_window"), "auto"), ("qwen3", "auto"),
                                              (family_with("sliding_window"), "fp8_e4m3")])  # GQA + a window; q/k norms
def test_compiled_decode_graph_function_gives_the_eager_logits(tiny_models, family, kv_cache):
    runner = _runner(tiny_models[family], torch.float64, "torch", kv_cache)
    batch = _decode_batch(runner, [5, 40, 130])  # width 160 (131 keys padded)
    eager = runner.forward(batch)
    before = _pool_copy(runner)
    graphs = CompiledDecode(runner.model, runner.attn, max_bs=4, max_context=CONTEXT, cache_dir="")
    assert graphs.describe() == "batch sizes 1, 2-4"
    graphs._step = graphs._forward  # the function torch.compile would compile, run as is
    with torch.inference_mode():
        got = graphs.run(batch)
    assert got.shape == eager.shape
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-9)
    _assert_only_written(before, runner, batch.out_cache_loc)


@pytest.mark.parametrize("backend, kv_cache", [("torch", "auto"), ("triton", "auto"), ("triton", "fp8_e5m2")])
def test_cuda_graph_static_batch_gives_the_eager_logits(tiny_models, backend, kv_cache):
    """What a CUDA graph replays — the bucket's static batch over the staged buffers — run
    eagerly on the CPU (the Triton kernels interpreted, float32: IEEE products, so the same
    bound as the kernel tests, far below a missing key's effect)."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    runner = _runner(tiny_models[family_with("sliding_window")], dtype, backend, kv_cache)
    batch = _decode_batch(runner, [7, 60, 33])
    eager = runner.forward(batch)
    before = _pool_copy(runner)
    graphs = CudaGraphDecode(runner, max_bs=4)
    assert graphs.batch_buckets == (1, 2, 4)
    with torch.inference_mode():
        b = graphs.stage(batch)
        got = graphs._forward(graphs._batch(b))
    assert b == 4 and got.shape[0] == 4
    atol = 1e-9 if dtype == torch.float64 else 1e-4 * float(eager.abs().max())
    torch.testing.assert_close(got[:3], eager, rtol=0, atol=atol)
    _assert_only_written(before, runner, batch.out_cache_loc)


def test_decode_step_resolution(monkeypatch):
    from batonlm.config import ServerArgs
    from batonlm.device.spec import DeviceConfigError, decode_step

    args = ServerArgs(compile="auto", max_running_requests=128)
    monkeypatch.delenv("CXX", raising=False)
    # Every native model, dense or a mixture of experts (its 2-64 row graph calls the grouped
    # experts as one op): this machine has a C++ compiler (g++ or c++).
    assert decode_step(args, "cpu") == (64, 0)
    assert decode_step(args.replace(compile="on"), "cpu") == (64, 0)
    assert decode_step(args.replace(max_running_requests=8), "cpu") == (8, 0)
    assert decode_step(args.replace(compile="off"), "cpu") == (0, 0)
    assert decode_step(args.replace(dtype="bfloat16"), "cpu") == (0, 0)  # auto: float32 only
    assert decode_step(args.replace(dtype="bfloat16", compile="on"), "cpu") == (64, 0)
    assert decode_step(args, "cuda") == (0, 128)
    assert decode_step(args.replace(cuda_graph_max_bs=24), "cuda") == (0, 24)
    assert decode_step(args.replace(disable_cuda_graph=True), "cuda") == (0, 0)
    assert decode_step(args, "cuda", attention="torch") == (0, 0)
    with pytest.raises(DeviceConfigError, match="--compile on applies to the CPU"):
        decode_step(args.replace(compile="on"), "cuda")
    monkeypatch.setenv("PATH", "")  # no compiler: auto stays eager, on tries (and falls back)
    assert decode_step(args, "cpu") == (0, 0)
    assert decode_step(args.replace(compile="on"), "cpu") == (64, 0)


def test_compile_flags_are_checked():
    from batonlm.cli import parse_serve_args
    from batonlm.config import ConfigError, ServerArgs

    with pytest.raises(ConfigError, match="compile: must be one of auto, on, off"):
        ServerArgs(compile="yes")
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)
    args = parse_serve_args(["--compile", "off", "--cuda-graph-max-bs", "32", "--disable-cuda-graph"])
    assert (args.compile, args.cuda_graph_max_bs, args.disable_cuda_graph) == ("off", 32, True)
