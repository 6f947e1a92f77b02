"""Shared test helpers: tiny models, transformers references, scheduler drivers."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import torch

from batonlm.config import ServerArgs
from batonlm.ipc.messages import AbortRequest, GenerateRequest
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.local_io import LocalIO, RequestRecord
from batonlm.scheduler.process import build_scheduler
from batonlm.scheduler.scheduler import Scheduler

VOCAB = 512  # the stories260K tokenizer's, copied into every tiny model
EOS = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(dst: Path) -> None:
    """Give a tiny model directory the embedded model's tokenizer (vocabulary 512)."""
    import shutil

    from batonlm.config import EMBEDDED_MODEL

    for name in TOKENIZER_FILES:
        shutil.copy(Path(EMBEDDED_MODEL) / name, dst / name)


TEST_MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "test-models"
# Every tiny test model, by family: a config file there adds one to every test of all families.
TEST_FAMILIES: tuple[str, ...] = tuple(sorted(p.stem for p in TEST_MODEL_CONFIGS.glob("*.json")))


# Architectures batonlm runs on transformers' modeling code (the fallback): not in TEST_FAMILIES,
# whose tests include tensor parallelism and the compiled step, which the fallback does not do.
FALLBACK_FAMILIES: tuple[str, ...] = tuple(sorted(p.stem for p in (TEST_MODEL_CONFIGS / "transformers").glob("*.json")))


def tiny_raw(family: str) -> dict[str, Any]:
    """configs/test-models/<family>.json (or transformers/<family>.json) as written."""
    folder = TEST_MODEL_CONFIGS / "transformers" if family in FALLBACK_FAMILIES else TEST_MODEL_CONFIGS
    return json.loads((folder / f"{family}.json").read_text())


def family_with(key: str) -> str:
    """The first test family whose config sets `key` (e.g. "sliding_window"), for tests of the
    property rather than of a family."""
    return next(f for f in TEST_FAMILIES if tiny_raw(f).get(key))


def tiny_config(family: str, **changes: Any):
    """The transformers config of a tiny test model (configs/test-models/<family>.json), with
    `changes` to its fields."""
    from transformers import AutoConfig

    raw = {**tiny_raw(family), **changes}
    model_type = raw.pop("model_type")
    raw.pop("architectures")
    return AutoConfig.for_model(model_type, **raw)


def hf_model_class(family: str):
    """The transformers class of a test family: its config's architecture."""
    import transformers

    return getattr(transformers, tiny_raw(family)["architectures"][0])


def randomize_biases_and_norms(model: torch.nn.Module) -> None:
    """transformers starts biases at 0 and norm weights at 1, where a bias added twice or a norm
    weight left out changes nothing: draw them (from torch's RNG, seeded by the caller)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks: large enough to take a share
                p.normal_(0.0, 2.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias, saved with the weights
                b.normal_(0.0, 0.2)


def build_tiny_model(family: str, path: Path, **changes: Any) -> None:
    torch.manual_seed(1234)
    model = hf_model_class(family)(tiny_config(family, **changes)).to(torch.float32)
    randomize_biases_and_norms(model)
    model.save_pretrained(path, safe_serialization=True)
    # Greedy generation with the same EOS everywhere.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 1}))


def hf_greedy(model_path: str, prompts: list[list[int]], max_new: list[int],
              dtype: torch.dtype = torch.float32, **load: Any) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding); `load`:
    more `from_pretrained` arguments (a `quantization_config`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **load).eval()
    outs = []
    with torch.no_grad():
        for ids, n in zip(prompts, max_new):
            gen = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=n, attention_mask=torch.ones(1, len(ids), dtype=torch.long)
            )
            outs.append(gen[0, len(ids):].tolist())
    return outs


def pooled_reference(path: str, prompt: list[int], pooling: str) -> tuple[torch.Tensor, float]:
    """Embeddings' reference: transformers' base model in float64, its last hidden states
    pooled by the last token or the mean, and the tolerance of a float32 engine: 64 float32 ulps
    of the largest value per layer (rounding grows about linearly with depth; a wrong position,
    a missed chunk or a left-out norm are off by order 1)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
    eps = torch.finfo(torch.float32).eps
    return pooled, 64 * eps * model.config.num_hidden_layers * float(hidden.abs().max())


def build_embedding_model(path: Path, pooling: str | None = None) -> str:
    """A tiny random Qwen3 saved as its base model (`Qwen3Model`: no LM head, tensors named
    without the `model.` prefix), as embedding checkpoints are; with `pooling` (last, mean, cls,
    max), a sentence-transformers pooling config beside it."""
    from transformers import Qwen3Model

    torch.manual_seed(99)
    model = Qwen3Model(tiny_config("qwen3")).to(torch.float32)
    randomize_biases_and_norms(model)
    model.save_pretrained(path, safe_serialization=True)
    copy_tokenizer(path)
    if pooling is not None:
        modes = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "last": "lasttoken"}
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": model.config.hidden_size,
            **{f"pooling_mode_{key}": mode == pooling for mode, key in modes.items()}}))
    return str(path)


def random_prompts(n: int, rng: random.Random, lo: int = 1, hi: int = 200, vocab: int = VOCAB) -> list[list[int]]:
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(n - 2)]
    # Start with BOS like a tokenized prompt; avoid the special ids 0-2 elsewhere.
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for length in lengths]


class SchedulerHarness:
    """A real scheduler (with its CPU device worker process) driven in-process by LocalIO."""

    def __init__(self, model: str, **server_args: Any) -> None:
        self.io = LocalIO()
        self.args = ServerArgs(model=model, **server_args)
        self.sched: Scheduler
        self.sched, self.info = build_scheduler(self.args, self.io)
        self.io.bind(lambda: self.sched.iteration)

    def submit(self, rid: str, ids: list[int], params: dict | SamplingParams, at: int = 0, priority: int = 0,
               pooling: str | None = None, lora: int = 0) -> None:
        """`lora`: the LoRA adapter's load key (--lora-paths: 1, 2, ... in order; 0: the base model)."""
        p = params if isinstance(params, SamplingParams) else SamplingParams(**params)
        self.io.submit(GenerateRequest(rid, ids, p, priority, pooling, lora), self.sched.iteration + at)

    def abort(self, rid: str) -> None:
        self.io.submit(AbortRequest(rid), self.sched.iteration)

    def run(self, overlap: bool) -> dict[str, RequestRecord]:
        """Run the chosen loop until every submitted request is done; return (and forget) records."""
        if overlap:
            self.sched.event_loop_overlap()
        else:
            self.sched.event_loop_normal()
        records = dict(self.io.records)
        self.io.records.clear()
        return records

    def reconfigure(self, kv_capacity: int | None = None, **changes: Any) -> None:
        """A fresh scheduler on the same device (its worker and weights): other scheduler
        settings (SchedulerConfig fields), or a smaller KV pool than the device's."""
        from batonlm.scheduler.kv_memory import KVMemory
        from batonlm.scheduler.scheduler import Scheduler

        config = dataclasses.replace(self.sched.config, **changes)
        self.sched = Scheduler(self.io, self.sched.device, config)
        if kv_capacity is not None:  # the first slots of the device's pool only
            spec = self.sched.device.spec
            assert kv_capacity <= spec.kv_capacity
            memory = KVMemory(kv_capacity, spec.num_req_slots, radix_cache=not config.disable_radix_cache)
            self.sched.memory = self.sched.planner.memory = memory

    def assert_all_free(self) -> None:
        """Nothing in use; only cached prefixes left, and after a flush, one free run."""
        s = self.sched.stats()
        mem = self.sched.memory
        mem.check_invariant()
        assert s.kv_used == 0, f"{s.kv_used} KV slots still in use"
        assert s.req_slots_used == 0, f"{s.req_slots_used} request slots still in use"
        assert not self.sched.requests and not self.sched.waiting and not self.sched.result_queue
        assert self.sched.flush_cache().ok
        assert mem.kv.num_free == mem.capacity and mem.kv.num_runs == 1, "freed KV slots should coalesce"

    def close(self) -> None:
        self.sched.device.close()


def build_byte_cycle_model(path: Path, text: str, lead_ids: tuple[int, ...] = (1,)) -> list[int]:
    """A one-layer Llama whose greedy output cycles through the byte-fallback tokens of `text`
    (its UTF-8 bytes): each token's embedding is its own basis vector, the layer adds nothing,
    and lm_head maps a token's vector onto the next token of the cycle; a prompt ending in one of
    `lead_ids` (BOS) leads into the cycle's first byte. Returns the cycle ids."""
    import transformers as tf

    byte_ids = [3 + b for b in text.encode("utf-8")]  # <0x00>..<0xFF> are ids 3..258
    assert len(set(byte_ids)) == len(byte_ids), "each byte of the cycle must be distinct"
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS)
    model = tf.LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for n in model.modules():
            if isinstance(n, tf.models.llama.modeling_llama.LlamaRMSNorm):
                n.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for i, t in enumerate(byte_ids):
            emb[t, i] = 1.0
            head[byte_ids[(i + 1) % len(byte_ids)], i] = 10.0
        for lead in lead_ids:  # BOS (and others) lead into the cycle's first byte
            emb[lead, len(byte_ids)] = 1.0
        head[byte_ids[0], len(byte_ids)] = 10.0
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 1}))
    return byte_ids
