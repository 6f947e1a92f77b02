"""LoRA adapters against PEFT: random adapters (ranks 4, 8 and 16, different target modules,
rsLoRA) made with `peft` on the embedded Llama; a batch mixing the base model and the three
adapters gives each request the tokens transformers + PEFT gives it alone (greedy, both loops,
chunked prefill, the prefix cache on: an adapter never reuses another's KV, but its own).
Served: a request selects an adapter by `model` (/generate: `lora_path`), /v1/models lists them,
and bad adapters are refused at start, naming why."""

from __future__ import annotations

import random
import re

import httpx
import pytest
import torch
from helpers import SchedulerHarness, random_prompts

from batonlm.bench.server_process import ServerProcess
from batonlm.sampling_params import SamplingParams

# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mlp16": (16, 32, ["gate_proj", "up_proj", "down_proj"], False),
}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def make_adapter(base_path: str, path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                     init_lora_weights=False)  # random A and B: a real change to the outputs
    get_peft_model(base, cfg).save_pretrained(str(path))


def peft_greedy(base_path: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: n tokens, an end-of-text one or not
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def make_adapters(base_path: str, root, specs: dict, seed: int = 0) -> dict[str, str]:
    """PEFT adapters on `base_path` in `root`: name -> (rank, alpha, target modules, rsLoRA)."""
    out = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(specs.items()):
        make_adapter(base_path, root / name, rank, alpha, targets, rslora, seed + i)
        out[name] = str(root / name)
    return out


def peft_references(base_path: str, adapters: dict[str, str], prompts: list[list[int]], n: int) -> dict:
    """(adapter name or None, prompt index) -> transformers + PEFT's greedy tokens alone."""
    return {(name, i): peft_greedy(base_path, adapters.get(name) if name else None, p, n)
            for name in (None, *adapters) for i, p in enumerate(prompts)}


def check_mixed_batch(h: SchedulerHarness, adapters: dict[str, str], prompts: list[list[int]], want: dict,
                      params: SamplingParams, overlaps: tuple[bool, ...] = (False, True)) -> None:
    """Every prompt on the base model and on each adapter (--lora-paths order: load keys 1..),
    all in one run per loop: each request's tokens are `want`'s, and nothing is left held."""
    for overlap in overlaps:
        for key, name in enumerate([None, *adapters]):
            for i, p in enumerate(prompts):
                h.submit(f"{name}-{i}", p, params, at=i, lora=key)
        records = h.run(overlap=overlap)
        for name in [None, *adapters]:
            for i in range(len(prompts)):
                assert records[f"{name}-{i}"].token_ids == want[(name, i)], (name, i, overlap)
        h.assert_all_free()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_path) -> dict[str, str]:
    return make_adapters(stories_path, tmp_path_factory.mktemp("lora"), ADAPTERS)


def lora_paths(adapters: dict[str, str]) -> str:
    return ",".join(f"{name}={path}" for name, path in adapters.items())


@pytest.fixture(scope="module")
def references(adapters, stories_path):
    prompts = random_prompts(2, random.Random(8), lo=6, hi=40, vocab=512)
    return prompts, peft_references(stories_path, adapters, prompts, 24)


# Under --tp 2 each rank holds its share of every adapter: A whole and B's rows for q/k/v and
# gate/up, A's columns and B whole for o and down (whose partial deltas the all-reduce sums).
@pytest.mark.parametrize(("chunk", "tp"), [(None, 1), (8, 1), (None, 2)], ids=["whole", "chunked", "tp2"])
def test_a_mixed_batch_gives_each_request_its_adapters_tokens(adapters, references, stories_path, chunk, tp):
    prompts, want = references
    assert want[("qv4", 0)] != want[(None, 0)] and want[("mlp16", 1)] != want[(None, 1)]  # the adapters change things
    h = SchedulerHarness(stories_path, chunked_prefill_size=chunk, lora_paths=lora_paths(adapters), tp_size=tp)
    try:
        check_mixed_batch(h, adapters, prompts, want, GREEDY)
    finally:
        h.close()


def test_the_compiled_step_adds_each_rows_adapter(tiny_models, tmp_path):
    """The compiled decode step with adapters (RowSlotLoRA: the rows' adapter slots are a graph
    input) in a batch mixing the base model and three adapters, both loops, two slots for three
    adapters (placements between steps change no graph): PEFT's tokens, the decodes compiled;
    then the base model alone, through the graphs without LoRA.
    On the two-layer test Llama: a graph half the size of stories260K's to compile."""
    from batonlm.kernels.toolchain import cxx_compiler

    if cxx_compiler() is None:
        pytest.skip("torch.compile needs a C++ compiler on the CPU")
    base = tiny_models["llama"]
    paths = make_adapters(base, tmp_path, ADAPTERS)
    prompts = random_prompts(2, random.Random(9), lo=6, hi=40, vocab=512)
    want = peft_references(base, paths, prompts, 12)
    h = SchedulerHarness(base, lora_paths=lora_paths(paths), max_loras_per_batch=2, compile="on",
                         compile_cache_dir=str(tmp_path / "inductor"), max_running_requests=8,
                         cpu_device_worker="inline")
    try:
        check_mixed_batch(h, paths, prompts, want, SHORT)
        runner = h.sched.device.executor.runner
        assert runner.decode_graphs is not None and runner.graph_steps > 0
        assert h.sched.lora is not None and h.sched.lora.placements > 0
        # Every graph, with and without LoRA, is called without dynamo (direct_graph.py).
        assert set(runner.decode_graphs._direct) == {(rows, one) for rows in (5, 6) for one in (True, False)}
        assert runner.decode_graphs.direct_steps == runner.graph_steps
        # The base model alone: its decodes run the graphs without LoRA.
        steps = runner.graph_steps
        for i, p in enumerate(prompts):
            h.submit(f"base-{i}", p, SHORT, at=i)
        records = h.run(overlap=True)
        assert [records[f"base-{i}"].token_ids for i in range(len(prompts))] == [want[(None, i)] for i in range(2)]
        assert runner.graph_steps > steps
    finally:
        h.close()


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_attention_adapters_on_a_mixture_of_experts(tiny_models, tmp_path, family):
    """A mixture of experts serves adapters of its attention (q/k/v/o; its experts are not
    adapted): a batch mixing the base model and two adapters gives PEFT's tokens, both loops.
    An adapter of its MLP is refused at start, naming the modules."""
    import json
    import shutil

    from batonlm.config import ServerArgs
    from batonlm.device.spec import DeviceConfigError, device_spec
    from batonlm.model_runner.model_config import ModelConfig

    base = tiny_models[family]
    specs = {"qkvo8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False), "qv4": (4, 8, ["q_proj", "v_proj"], True)}
    paths = make_adapters(base, tmp_path, specs, seed=20)
    prompts = random_prompts(2, random.Random(5), lo=6, hi=40, vocab=512)
    want = peft_references(base, paths, prompts, 12)
    assert want[("qkvo8", 0)] != want[(None, 0)]  # the adapter changes things
    h = SchedulerHarness(base, lora_paths=lora_paths(paths))
    try:
        check_mixed_batch(h, paths, prompts, want, SHORT)
    finally:
        h.close()
    mlp = tmp_path / "mlp"
    shutil.copytree(paths["qv4"], mlp)
    cfg = json.loads((mlp / "adapter_config.json").read_text())
    (mlp / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "gate_proj", "up_proj"]}))
    with pytest.raises(DeviceConfigError, match=r"\['gate_proj', 'up_proj'\] are in the MLP of a mixture-of-experts"):
        device_spec(ServerArgs(model=base, lora_paths=f"mlp={mlp}"), ModelConfig.from_hf(base))


def test_ngram_speculation_verifies_with_the_requests_adapter(adapters, stories_path):
    """A verifying request's rows (its newest token and its drafts) run with its adapter: the
    tokens are PEFT's, drafts accepted or not."""
    prompt = [1] + [400, 401, 402, 403, 404] * 6  # repeated n-grams: drafts from the start
    want = {name: peft_greedy(stories_path, adapters.get(name) if name else None, prompt, 24)
            for name in (None, "qv4", "all8")}
    h = SchedulerHarness(stories_path, lora_paths=lora_paths(adapters), speculative_algorithm="ngram")
    try:
        for slot, name in enumerate([None, "qv4", "all8"]):
            h.submit(f"{name}", prompt, GREEDY, lora=slot)
        records = h.run(overlap=True)
        for name in (None, "qv4", "all8"):
            assert records[f"{name}"].token_ids == want[name], name
        assert h.sched.speculator is not None and h.sched.speculator.stats.steps > 0
        h.assert_all_free()
    finally:
        h.close()


@pytest.mark.parametrize(("slots", "overlap"), [(1, True), (2, False)])
def test_adapters_take_turns_in_fewer_slots(adapters, references, stories_path, slots, overlap):
    """Three adapters, --max-loras-per-batch 1 or 2 device slots: no batch holds more adapters than
    slots (the base model's requests join any), the adapters are copied in and out of the slots
    (least recently used out) as their requests are admitted, and every request still gets
    PEFT's tokens."""
    prompts, want = references
    h = SchedulerHarness(stories_path, lora_paths=lora_paths(adapters), max_loras_per_batch=slots)
    seen: list[tuple[set[int], set[int]]] = []  # per batch: its adapters (load keys), their slots
    plan = h.sched.planner.plan

    def recording_plan(*a, **kw):
        batch = plan(*a, **kw)
        seen.append(({r.lora_key for r in batch.reqs if r.lora_key}, {r.lora for r in batch.reqs if r.lora_key}))
        return batch

    h.sched.planner.plan = recording_plan
    try:
        check_mixed_batch(h, adapters, prompts, want, GREEDY, overlaps=(overlap,))
        assert max(len(keys) for keys, _ in seen) == slots
        assert set().union(*(keys for keys, _ in seen)) == {1, 2, 3}
        assert set().union(*(used for _, used in seen)) == set(range(1, slots + 1))
        assert h.sched.lora is not None and h.sched.lora.placements >= 3 - slots
        h.assert_all_free()
    finally:
        h.close()


def test_a_waiting_adapter_is_not_overtaken_by_a_busy_one(adapters, stories_path):
    """One slot, a stream of requests for one adapter and one request for another arriving in
    between: the slot drains for it (the first adapter's later requests wait behind it) instead
    of the first adapter holding the slot as long as its requests keep coming; base-model
    requests are not held back."""
    h = SchedulerHarness(stories_path, lora_paths=lora_paths(adapters), max_loras_per_batch=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    try:
        for i in range(16):
            h.submit(f"qv4-{i}", [1, 400 + i], params, at=i, lora=1)
        h.submit("all8", [1, 300], params, at=2, lora=2)
        h.submit("base", [1, 301], params, at=3)
        records = h.run(overlap=True)
        first = {rid: rec.token_times[0] for rid, rec in records.items()}
        later = [f"qv4-{i}" for i in range(3, 16)]  # arrived after all8
        assert all(first[rid] > first["all8"] for rid in later), sorted(first, key=first.get)
        assert first["base"] < first["all8"]  # the base model went ahead
        h.assert_all_free()
    finally:
        h.close()


def test_the_prefix_cache_is_kept_per_adapter(adapters, references, stories_path):
    prompts, want = references
    h = SchedulerHarness(stories_path, lora_paths=lora_paths(adapters))
    try:
        h.submit("base", prompts[1], GREEDY)
        h.run(overlap=True)
        cached = h.sched.memory.cached_tokens
        h.submit("qv4", prompts[1], GREEDY, lora=1)  # the same prompt: the base's KV is not its own
        assert h.run(overlap=True)["qv4"].token_ids == want[("qv4", 1)]
        assert h.sched.memory.cached_tokens == cached
        h.submit("qv4-again", prompts[1], GREEDY, lora=1)  # its own prefix: reused
        assert h.run(overlap=True)["qv4-again"].token_ids == want[("qv4", 1)]
        assert h.sched.memory.cached_tokens >= cached + len(prompts[1]) - 1
        h.assert_all_free()
    finally:
        h.close()


def test_bad_adapters_are_refused_at_start(adapters, stories_path, tmp_path):
    from batonlm.config import ConfigError, ServerArgs
    from batonlm.device.spec import DeviceConfigError, device_spec
    from batonlm.model_runner.model_config import ModelConfig

    cfg = ModelConfig.from_hf(stories_path)
    cases = [
        (f"big={adapters['mlp16']}", {"max_lora_rank": 8}, "rank 16 is over --max-lora-rank 8"),
        (f"nope={tmp_path}", {}, "not a PEFT adapter directory"),
    ]
    for paths, extra, words in cases:
        with pytest.raises(DeviceConfigError, match=words):
            device_spec(ServerArgs(model=stories_path, lora_paths=paths, **extra), cfg)
    with pytest.raises(ConfigError, match="each adapter is name=DIR"):
        _ = ServerArgs(model=stories_path, lora_paths="justaname").lora_adapters
    with pytest.raises(ConfigError, match="do not combine with DP attention"):
        ServerArgs(model=stories_path, lora_paths=f"a={adapters['qv4']}", dp_size=2, enable_dp_attention=True)


def test_served_adapters(adapters, references, stories_path):
    prompts, want = references
    server = ServerProcess("--lora-paths", lora_paths(adapters))
    try:
        url = server.base_url
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("stories260K", None), ("qv4", "stories260K"),
                                                                  ("all8", "stories260K"), ("mlp16", "stories260K")]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(stories_path)
        body = {"prompt": prompts[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        for name in (None, "qv4", "all8"):
            r = httpx.post(url + "/v1/completions", json={**body, **({"model": name} if name else {})}, timeout=60)
            assert r.status_code == 200, r.text
            text = tok.decode(prompts[0] + want[(name, 0)])[len(tok.decode(prompts[0])):]
            assert r.json()["choices"][0]["text"] == text, name
        gen = httpx.post(url + "/generate", json={"input_ids": prompts[1], "lora_path": "mlp16", "sampling_params": {
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}, timeout=60).json()
        assert gen["output_ids"] == want[("mlp16", 1)]
        for field, body in (("model", {"model": "nope", "prompt": "hi"}), ("lora_path", None)):
            if body is None:
                r = httpx.post(url + "/generate", json={"text": "hi", "lora_path": "nope"})
            else:
                r = httpx.post(url + "/v1/completions", json=body)
            assert r.status_code == 404 and r.json()["error"]["param"] == field
    finally:
        assert server.stop() == 0, server.log()


def test_load_and_unload_at_run_time_under_traffic(adapters, references, stories_path, tmp_path):
    """Two adapters at once (--max-loaded-loras 2, rank up to 8) taking turns in one device slot
    (--max-loras-per-batch 1): one from the start, one loaded at run time; a full server refuses a
    third; once one is unloaded, another loaded in its place answers with its own tokens (not the
    old adapter's weights, nor its cached prefix), and so does the first after it, while
    base-model streams run throughout unchanged."""
    import threading

    prompts, want = references
    make_adapter(stories_path, tmp_path / "ko8", 8, 8, ["k_proj", "o_proj"], False, seed=11)
    ko8 = peft_greedy(stories_path, str(tmp_path / "ko8"), prompts[0], 24)
    server = ServerProcess("--lora-paths", f"qv4={adapters['qv4']}", "--max-loaded-loras", "2",
                           "--max-loras-per-batch", "1", "--max-lora-rank", "8")
    url = server.base_url

    def complete(model: str | None, prompt: list[int], n: int = 24, **extra) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
        return httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **({"lora_path": model} if model else {})},
            timeout=120) if not body.get("stream") else httpx.post(url + "/v1/completions", json=body, timeout=120)

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=60)

    base_outputs: list[list[int]] = []
    stop = threading.Event()

    def base_traffic() -> None:
        while not stop.is_set():
            base_outputs.append(complete(None, prompts[0]).json()["output_ids"])

    traffic = threading.Thread(target=base_traffic)
    traffic.start()
    try:
        assert post("/v1/load_lora_adapter", {"lora_name": "all8", "lora_path": adapters["all8"]}).status_code == 200
        assert complete("all8", prompts[0]).json()["output_ids"] == want[("all8", 0)]
        assert complete("qv4", prompts[0]).json()["output_ids"] == want[("qv4", 0)]
        # Full: a third adapter waits for room. Too big a rank, a wrong directory, a name in use: 400s.
        r = post("/v1/load_lora_adapter", {"lora_name": "ko8", "lora_path": str(tmp_path / "ko8")})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_adapters"
        for body, param, words in (
            ({"lora_name": "big", "lora_path": adapters["mlp16"]}, "lora_path", "over --max-lora-rank 8"),
            ({"lora_name": "nope", "lora_path": str(tmp_path)}, "lora_path", "not a PEFT adapter"),
            ({"lora_name": "qv4", "lora_path": adapters["qv4"]}, "lora_name", "already served"),
            ({"lora_name": "stories260K", "lora_path": adapters["qv4"]}, "lora_name", "already served"),
        ):
            r = post("/v1/load_lora_adapter", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
        assert post("/v1/unload_lora_adapter", {"lora_name": "all8"}).status_code == 200
        r = complete("all8", prompts[0])
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
        # Its room takes another adapter, which answers with its own tokens on the same prompt.
        assert post("/v1/load_lora_adapter", {"lora_name": "ko8", "lora_path": str(tmp_path / "ko8")}).status_code == 200
        assert complete("ko8", prompts[0]).json()["output_ids"] == ko8
        assert complete("qv4", prompts[0]).json()["output_ids"] == want[("qv4", 0)]
        # One slot for two adapters: each of all8, qv4, ko8, qv4 was copied in for its turn.
        metrics = httpx.get(url + "/metrics").text
        placed = float(re.search(r'^batonlm_lora_adapter_placements\{[^}]*\} (\S+)$', metrics, re.M).group(1))
        assert placed >= 4, placed
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["stories260K", "qv4", "ko8"]
        r = post("/v1/unload_lora_adapter", {"lora_name": "stories260K"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        r = post("/v1/unload_lora_adapter", {"lora_name": "all8"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    finally:
        stop.set()
        traffic.join(120)
        code = server.stop()
    assert code == 0, server.log()
    assert base_outputs and all(out == want[(None, 0)] for out in base_outputs)


def test_an_adapter_with_requests_running_is_not_unloaded():
    from batonlm.config import ServerArgs
    from batonlm.server.errors import APIError
    from batonlm.server.lora_adapters import AdapterRegistry

    registry = AdapterRegistry(ServerArgs(lora_paths="a=/x,b=/y", max_loaded_loras=3))
    assert registry.has_room() and registry.next_key == 3
    registry.loading.add("c")
    assert not registry.has_room()
    registry.loading.clear()
    with pytest.raises(APIError, match="has 2 request") as e:
        registry.unload("a", lambda key: 2 if key == 1 else 0)
    assert e.value.code == "adapter_in_use" and "a" in registry.by_name
    assert registry.unload("a", lambda key: 0).key == 1 and registry.has_room()
    with pytest.raises(APIError, match="does not exist"):
        registry.unload("a", lambda key: 0)


def test_the_lora_mix_benchmark_runs_end_to_end(tmp_path):
    """benchmarks/lora_mix.py as its docstring runs it, in small: every mix measured (the base
    model with LoRA off, adapters loaded but unused, two adapters mixed), each at a rate."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_mix.py"
    out = tmp_path / "lora_mix.json"
    done = subprocess.run([sys.executable, str(script), "--streams", "4", "--adapters-in-use", "0", "2",
                           "--new-tokens", "8", "--rounds", "1", "--compile", "off", "--output-json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["adapters_in_use"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"LoRA off", 0, 2} and rows["LoRA off"]["ratio_to_lora_off"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["device_per_iter_ms"] > 0 for r in rows.values())
    assert "adapters in use" in done.stdout


@pytest.mark.parametrize("fmt, packed", [("gptq", False), ("gptq", True), ("nf4", True)],
                         ids=["dequantized", "packed", "nf4-packed"])
def test_adapters_on_a_quantized_base(adapters, references, stories_path, tmp_path, monkeypatch, fmt, packed):
    """Adapters trained on the float model served on its GPTQ int4 checkpoint, or its bitsandbytes
    NF4 one (QLoRA's own base format): each request gets transformers + PEFT's tokens on the float
    model the checkpoint means (its dequantized weights), base rows and adapter rows mixed in one
    batch; with the projections dequantized on load (the CPU's default) or kept packed (CUDA's,
    forced here in an inline device: `PackedIntLinear`, with NF4's table, its torch reference
    exact in float32)."""
    from quant_bnb import write_bnb4_checkpoint
    from quant_formats import save_dequantized, write_gptq_checkpoint

    prompts, _ = references
    gptq = tmp_path / fmt
    # The attention projections: the MLP's 172 features do not pack into int32 words of 8 (GPTQ
    # would leave them float too), nor into NF4's blocks of 64 per row.
    linears = ("q_proj", "k_proj", "v_proj", "o_proj")
    if fmt == "gptq":
        deq = write_gptq_checkpoint(stories_path, gptq, bits=4, group_size=64, sym=False, linears=linears)
    else:
        deq = write_bnb4_checkpoint(stories_path, gptq, blocksize=64, linears=linears)
    save_dequantized(gptq, deq, tmp_path / "float")
    want = peft_references(str(tmp_path / "float"), adapters, prompts, 12)
    assert want[(None, 0)] != peft_greedy(stories_path, None, prompts[0], 12)  # the base is the quantized one
    extra = {}
    if packed:
        from batonlm.model_runner import model_loader

        monkeypatch.setattr(model_loader, "keeps_quantized", lambda cfg, device: True)
        extra = {"cpu_device_worker": "inline"}
    h = SchedulerHarness(str(gptq), lora_paths=lora_paths(adapters), **extra)
    try:
        if packed:
            from batonlm.model_runner.quantization.linear import PackedIntLinear

            model = h.sched.device.executor.runner.model
            assert sum(isinstance(m, PackedIntLinear) for m in model.modules()) == 2 * 5  # qkv and o, 5 layers
        check_mixed_batch(h, adapters, prompts, want, SHORT, overlaps=(True,))
    finally:
        h.close()
