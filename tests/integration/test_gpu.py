"""The CUDA device path: forward and copy streams, pinned copies, the Triton sampler.
These run only where CUDA is available (benchmarks/gpu_check.sh runs them in one go)."""

import random

import pytest
from helpers import TEST_FAMILIES, SchedulerHarness, family_with, hf_greedy, random_prompts

pytestmark = pytest.mark.gpu


def _run(h: SchedulerHarness, reqs, overlap: bool):
    for rid, ids, params, at in reqs:
        h.submit(rid, ids, params, at=at)
    records = h.run(overlap=overlap)
    h.assert_all_free()
    return {k: v.token_ids for k, v in records.items()}


def _greedy_is_transformers(path: str, rng: random.Random, n: int, hi: int, **harness) -> None:
    """n random prompts (up to `hi` tokens) on CUDA in float32, overlap loop: transformers' greedy tokens."""
    prompts = random_prompts(n, rng, lo=1, hi=hi)
    max_new = [rng.randint(8, 24) for _ in prompts]
    expected = hf_greedy(path, prompts, max_new)
    h = SchedulerHarness(path, device="cuda", dtype="float32", **harness)
    try:
        reqs = [(f"r{i}", p, {"temperature": 0.0, "max_new_tokens": k}, 2 * i)
                for i, (p, k) in enumerate(zip(prompts, max_new))]
        got = _run(h, reqs, overlap=True)
        assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    finally:
        h.close()


@pytest.mark.parametrize("family", TEST_FAMILIES)
def test_cuda_greedy_matches_transformers(tiny_models, family):
    _greedy_is_transformers(tiny_models[family], random.Random(5), 8, 200, sampler="triton")


def test_cuda_overlap_equals_normal_with_triton_sampling(stories_path):
    rng = random.Random(9)
    reqs = []
    for i in range(32):
        ids = [1] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 100))]
        params = {"max_new_tokens": rng.randint(1, 64), "temperature": rng.choice([0.0, 0.8]),
                  "top_p": 0.9, "seed": rng.randrange(2**32)}
        reqs.append((f"r{i}", ids, params, rng.randint(0, 40)))
    h = SchedulerHarness(stories_path, device="cuda", sampler="triton", dtype="float32")
    try:
        assert _run(h, reqs, overlap=False) == _run(h, reqs, overlap=True)
    finally:
        h.close()


def test_cuda_torch_and_triton_samplers_agree(stories_path):
    reqs = [(f"r{i}", [1, 403, 407, 261, 378][: i + 1],
             {"max_new_tokens": 32, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": i,
              "frequency_penalty": 0.5, "logit_bias": {261: 1.0}}, 0) for i in range(5)]
    outs = []
    for sampler in ("torch", "triton"):
        h = SchedulerHarness(stories_path, device="cuda", sampler=sampler, dtype="float32")
        try:
            outs.append(_run(h, reqs, overlap=True))
        finally:
            h.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", ["llama", family_with("sliding_window")])
def test_cuda_triton_attention_equals_torch_attention(tiny_models, family):
    """Greedy tokens through the Triton attention backend (the CUDA default) and the torch one,
    with chunks on a shared cached prefix and decodes (GQA; and a sliding window)."""
    rng = random.Random(6)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    reqs = [(f"r{i}", shared + [rng.randrange(3, 512) for _ in range(rng.randint(1, 60))],
             {"max_new_tokens": 24, "temperature": 0.0}, i) for i in range(10)]
    outs = []
    for backend in ("torch", "triton"):
        h = SchedulerHarness(tiny_models[family], device="cuda", dtype="float32", attention_backend=backend,
                             chunked_prefill_size=32)
        try:
            outs.append(_run(h, reqs, overlap=True))
        finally:
            h.close()
    assert outs[0] == outs[1]


def test_cuda_gpt_oss_attention_sinks_on_triton_match_transformers(tmp_path):
    """gpt-oss on transformers' code through the Triton attention kernels on the GPU: its sinks
    (a logit per head in each softmax's denominator) in the extend kernel and the split-KV decode
    merge; transformers' greedy tokens (float32)."""
    from helpers import build_tiny_model, copy_tokenizer

    path = tmp_path / "gpt_oss"
    build_tiny_model("gpt_oss", path)
    copy_tokenizer(path)
    _greedy_is_transformers(str(path), random.Random(8), 6, 120, attention_backend="triton", chunked_prefill_size=32)


def _graph_runner(h: SchedulerHarness):
    return h.sched.device.executor.runner


@pytest.mark.parametrize("model", ["stories", family_with("sliding_window")])
def test_cuda_graphs_give_the_eager_tokens_in_both_loops(request, model):
    """Decode batches replayed from CUDA graphs (ids from the FutureMap relay copied into the
    graph's buffer, padded buckets, the Triton sampler after) == the eager step, fp32, greedy
    and seeded, normal and overlap loop."""
    path = request.getfixturevalue("stories_path") if model == "stories" else request.getfixturevalue("tiny_models")[model]
    rng = random.Random(12)
    reqs = [(f"r{i}", [1] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 90))],
             {"max_new_tokens": rng.randint(8, 40), "temperature": rng.choice([0.0, 0.9]), "seed": i}, rng.randint(0, 30))
            for i in range(24)]
    outs = {}
    for graphs in (False, True):
        h = SchedulerHarness(path, device="cuda", dtype="float32", sampler="triton", disable_cuda_graph=not graphs,
                             max_running_requests=16)
        try:
            runner = _graph_runner(h)
            assert (runner.decode_graphs is not None) == graphs
            for overlap in (False, True):
                outs[graphs, overlap] = _run(h, reqs, overlap=overlap)
            assert (runner.graph_steps > 0) == graphs
        finally:
            h.close()
    assert outs[True, True] == outs[True, False] == outs[False, True] == outs[False, False]


@pytest.mark.parametrize("kv_cache", ["auto", "fp8_e4m3"])
def test_cuda_graph_logits_match_eager_in_bfloat16(tiny_models, kv_cache):
    """bf16: the graph's logits against the eager step's on the same decode batch (3 rows in
    the bucket of 4). Different batch shapes may round differently, so the bound is a few bf16
    units (2^-8 relative) of the largest logit per layer, not equality. With an FP8 KV cache the
    graph writes and reads the FP8 pool (the scales are constants of the capture)."""
    import torch

    from batonlm.model_runner.cuda_graph_decode import CudaGraphDecode
    from batonlm.model_runner.forward_batch import ForwardBatch

    h = SchedulerHarness(tiny_models["llama"], device="cuda", dtype="bfloat16", disable_cuda_graph=True,
                         kv_cache_dtype=kv_cache)
    try:
        runner = _graph_runner(h)
        lengths, loc, start = [9, 70, 33], [], 1
        for n in lengths:
            loc.append(torch.arange(start, start + n))
            start += n + 1
        dev = runner.device
        ids = torch.randint(3, 512, (sum(lengths),), device=dev)
        runner.forward(ForwardBatch.build(torch.cat(loc).to(dev), [1, 2, 3], [0, 0, 0], lengths, dev, input_ids=ids))
        decode_loc = torch.tensor([int(x[-1]) + 1 for x in loc], device=dev)
        batch = ForwardBatch.build(decode_loc, [1, 2, 3], lengths, [1, 1, 1], dev,
                                   input_ids=torch.randint(3, 512, (3,), device=dev))
        eager = runner.forward(batch)
        graphs = CudaGraphDecode(runner, max_bs=4)
        graphs.prepare(lambda _: None)
        got = graphs.run(batch)
        layers = runner.cfg.num_layers
        torch.testing.assert_close(got, eager, rtol=0, atol=layers * 4 * 2**-8 * float(eager.abs().max()))
    finally:
        h.close()


def test_cuda_speculative_decoding_equals_plain_decoding(stories_path):
    """N-gram speculative decoding on CUDA (verifying rows replayed from CUDA graphs, the Triton
    attention and sampler) emits the plain run's tokens, greedy and seeded, both loops."""
    from batonlm.scheduler.speculative import SpecConfig

    reqs = [(f"r{i}", [1] + [403, 407, 261, 378] * (1 + i % 3), {"max_new_tokens": 60 + 7 * i,
             "temperature": 0.0 if i % 2 else 0.8, "seed": i}, i % 4) for i in range(8)]
    h = SchedulerHarness(stories_path, device="cuda", dtype="float32", sampler="triton", max_running_requests=16)
    try:
        for overlap in (False, True):
            h.reconfigure(speculative=None)
            plain = _run(h, reqs, overlap)
            h.reconfigure(speculative=SpecConfig(cost_ratio=0.0))
            spec = _run(h, reqs, overlap)
            assert spec == plain
            assert h.sched.speculator.stats.steps > 0
    finally:
        h.close()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_one_gpu(tiny_models, tp):
    """NCCL all-reduces and the logits' all-gather, captured in CUDA graphs: --tp gives the
    one-GPU greedy tokens (fp32)."""
    if _gpus() < tp:
        pytest.skip(f"needs {tp} GPUs")
    rng = random.Random(tp)
    prompts = random_prompts(8, rng, lo=1, hi=150)
    reqs = [(f"r{i}", p, {"temperature": 0.0, "max_new_tokens": 16}, i) for i, p in enumerate(prompts)]
    results = []
    for size in (1, tp):
        h = SchedulerHarness(tiny_models["llama"], device="cuda", dtype="float32", tp_size=size,
                             debug_tp_check_every=1 if size > 1 else 0)
        try:
            results.append(_run(h, reqs, overlap=True))
        finally:
            h.close()
    assert results[0] == results[1]


def test_dp_attention_matches_one_gpu(stories_path):
    """--dp 2 --enable-dp-attention on two GPUs through the server: the one-GPU greedy text."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    import httpx

    from batonlm.bench.server_process import ServerProcess

    def texts(*flags):
        s = ServerProcess("--device", "cuda", "--dtype", "float32", *flags)
        try:
            body = {"model": "stories260K", "max_tokens": 24, "temperature": 0}
            return [httpx.post(s.base_url + "/v1/completions", json={**body, "prompt": p}, timeout=60).json()
                    ["choices"][0]["text"] for p in ("Once upon a time", "Lily and Tom", "The sun")]
        finally:
            s.stop()

    assert texts("--dp", "2", "--enable-dp-attention") == texts()


def test_cuda_lora_mixed_batch_in_graphs_and_eager(stories_path, tmp_path):
    """LoRA on a GPU: three PEFT adapters in two slots and the base model in one batch; prefills
    through the Triton segment kernels, decodes through the CUDA graphs (the rows' adapter
    slots a graph input): every request gets PEFT's tokens, in both loops."""
    from test_lora import ADAPTERS, SHORT, check_mixed_batch, lora_paths, make_adapters, peft_references

    paths = make_adapters(stories_path, tmp_path, ADAPTERS)
    prompts = random_prompts(2, random.Random(9), lo=6, hi=40, vocab=512)
    want = peft_references(stories_path, paths, prompts, 12)
    h = SchedulerHarness(stories_path, device="cuda", dtype="float32", sampler="triton",
                         lora_paths=lora_paths(paths), max_loras_per_batch=2)
    try:
        check_mixed_batch(h, paths, prompts, want, SHORT)
        h.submit("base", prompts[0], SHORT)  # the base model alone: the graphs without LoRA
        assert h.run(overlap=True)["base"].token_ids == want[(None, 0)]
    finally:
        h.close()
