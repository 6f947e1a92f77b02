"""Shared test helpers: tiny models, transformers references, scheduler drivers."""

from __future__ import annotations

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


def tiny_config(family: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=EOS,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        return tf.LlamaConfig(
            **common,
            head_dim=24,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=24, tie_word_embeddings=False)
    raise ValueError(family)


def hf_model_class(family: str):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "mistral": tf.MistralForCausalLM,
    }[family]


def build_tiny_model(family: str, path: Path) -> None:
    torch.manual_seed(1234)
    model = hf_model_class(family)(tiny_config(family)).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    # Greedy generation with the same EOS everywhere.
    import json

    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 1}))


def hf_greedy(model_path: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids, n in zip(prompts, max_new):
            gen = model.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=n, attention_mask=torch.ones(1, len(ids), dtype=torch.long)
            )
            outs.append(gen[0, len(ids):].tolist())
    return outs


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

    def submit(self, rid: str, ids: list[int], params: dict | SamplingParams, at: int = 0) -> None:
        p = params if isinstance(params, SamplingParams) else SamplingParams(**params)
        self.io.submit(GenerateRequest(rid, ids, p), self.sched.iteration + at)

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

    def assert_all_free(self) -> None:
        s = self.sched.stats()
        assert s.kv_slots_used == 0, f"{s.kv_slots_used} KV slots still in use"
        assert s.req_slots_used == 0, f"{s.req_slots_used} request slots still in use"
        assert self.sched.budget.reserved == 0, f"{self.sched.budget.reserved} KV slots still reserved"
        assert not self.sched.requests and not self.sched.waiting and not self.sched.result_queue

    def close(self) -> None:
        self.sched.device.close()
