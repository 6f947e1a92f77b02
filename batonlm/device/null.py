"""`--device null`: a device that computes nothing, to measure and test the host side alone.

It keeps everything but the model: the scheduler, KV and request-slot accounting, the radix
cache, both loops and the FutureMap relay (decode rows read their input from it, as on a real
device). Each row's "sampled" token is a fixed function of its input token and position
(`null_tokens`), so a run is reproducible, the overlap loop must give the normal loop's tokens,
and a retracted request regenerates the tokens it lost. Grammar masks and bans are honoured
(the next allowed token), so constrained output stays valid.

A real device computes a launch while the host goes on; this one models that with a time line:
a launch starts when the device is free (or at once), takes `--null-step-ms`, and its result is
ready then. `wait()` sleeps until it is (0 ms: never). The share of time the modelled device
sits idle is the host side's cost a GPU would see (`compute_s`, `/metrics`
`batonlm_device_idle_ratio`). Never chosen implicitly: only `--device null` builds it.
"""

from __future__ import annotations

import re
import time

import torch

from batonlm.device.base import DeviceStream, PendingResult, host_result
from batonlm.device.batch_executor import relay_outputs, resolve_input_ids
from batonlm.device.future_map import FutureMap
from batonlm.device.spec import DeviceSpec
from batonlm.ipc.device_messages import BatchLaunch, BatchResult, LoRAMessage, SampleLaunch
from batonlm.model_runner import spec_verify
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.host_to_device import to_device
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.sampler import SampleOutput

_A, _B, _C = 40503, 2654435761, 12345  # any odd multipliers spread ids over the table
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def token_table(cfg: ModelConfig) -> torch.Tensor:
    """The ids the null device emits: ordinary tokens that decode to text, as a model's mostly do
    (the detokenizer's cost is then a real model's): none of the model's special tokens (BOS,
    EOS, padding, and the tokenizer's), no byte-fallback piece (<0x41>: alone, most are not
    UTF-8), no id past the tokenizer's vocabulary. Every id below the vocabulary size but the
    specials when the tokenizer cannot be read."""
    raw = cfg.raw
    special = {*cfg.eos_token_ids, *(raw.get(k) for k in ("bos_token_id", "pad_token_id"))}
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.path)
        special |= set(tok.all_special_ids)
        pieces = tok.convert_ids_to_tokens(list(range(min(len(tok), cfg.vocab_size))))
    except Exception:  # no tokenizer files with the model: ids alone
        pieces = [""] * cfg.vocab_size
    ids = [i for i, p in enumerate(pieces) if i not in special and not _BYTE_PIECE.fullmatch(p or "")]
    return torch.tensor(ids, dtype=torch.int64)


def null_tokens(inputs: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The token after `inputs` at `positions` (the input's position): the null device's model."""
    return table[(inputs * _A + positions * _B + _C) % len(table)]


def next_allowed(tokens: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Per row, the first allowed id at or after the row's token (cyclically): allowed [R, V]."""
    vocab = allowed.shape[1]
    order = (torch.arange(vocab)[None, :] - tokens[:, None]) % vocab  # distance from the token
    dist = torch.where(allowed, order, vocab)
    return (tokens + dist.min(dim=1).values) % vocab


class _NullPending(PendingResult):
    def __init__(self, batch_id: int, ready_at: float) -> None:
        self.batch_id = batch_id
        self.ready_at = ready_at
        self.result: BatchResult | None = None

    def wait(self) -> BatchResult:
        assert self.result is not None, "delayed sampling was never launched"
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self.result


class NullDevice(DeviceStream):
    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        # Its tensors are a batch's ids and masks, far too small to split; a second intra-op thread
        # only waits for a core the frontend holds (a constrained batch took 12 ms a step with two).
        torch.set_num_threads(1)
        cfg = ModelConfig.from_hf(spec.model_path, spec.model_impl, "none")
        self.vocab, self.hidden = cfg.vocab_size, cfg.hidden_size
        self.table = token_table(cfg)
        self.step_s = spec.null_step_ms / 1000
        self.future_map = FutureMap(spec.num_req_slots, "cpu", debug=spec.debug_future_map)
        self._free_at = 0.0  # when the modelled device finishes the work launched so far
        self.compute_s = 0.0
        self._delayed: dict[int, tuple[_NullPending, ForwardBatch, BatchLaunch, torch.Tensor]] = {}

    def _occupy(self) -> float:
        """Queue one step on the modelled device; returns when it completes."""
        self._free_at = max(time.perf_counter(), self._free_at) + self.step_s
        self.compute_s += self.step_s
        return self._free_at

    def launch(self, launch: BatchLaunch) -> PendingResult:
        batch = ForwardBatch.build(to_device(launch.out_cache_loc, torch.int64, torch.device("cpu")),
                                   launch.req_slots, launch.prefix_lens, launch.extend_lens, "cpu")
        batch.input_ids = resolve_input_ids(launch, batch, self.future_map)
        last = batch.input_ids[batch.last_token_index]
        tokens = null_tokens(last, batch.seq_lens - 1, self.table)
        pending = _NullPending(launch.batch_id, self._occupy())
        if launch.sample:
            pending.result = self._finish(batch, launch, tokens)
        else:
            self._delayed[launch.batch_id] = (pending, batch, launch, tokens)
        return pending

    def launch_sampling(self, sample: SampleLaunch) -> None:
        pending, batch, launch, tokens = self._delayed.pop(sample.batch_id)
        rows = [*sample.banned, *sample.mask_rows]
        if rows:
            allowed = torch.ones(len(rows), self.vocab, dtype=torch.bool)
            for i, ids in enumerate(sample.banned.values()):
                allowed[i, ids] = False
            if sample.mask_rows:
                words = torch.frombuffer(bytearray(sample.bitmask), dtype=torch.int32)
                words = words.view(len(sample.mask_rows), sample.mask_words)
                bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
                masks = bits.reshape(len(sample.mask_rows), -1)[:, : self.vocab].bool()
                allowed[len(sample.banned):] &= masks
            at = torch.tensor(rows)
            tokens[at] = next_allowed(tokens[at], allowed)
        pending.result = self._finish(batch, launch, tokens)

    def _finish(self, batch: ForwardBatch, launch: BatchLaunch, tokens: torch.Tensor) -> BatchResult:
        verified = None
        if launch.verify_groups:
            assert batch.input_ids is not None
            verified = spec_verify.accept_drafts(tokens, batch.input_ids[batch.last_token_index], launch.verify_groups)
        relay_outputs(self.future_map, batch, launch, tokens, verified)
        out = SampleOutput(tokens, accepted=None if verified is None else verified[0])
        if launch.top_logprobs >= 0:  # the chosen token certain, the alternatives after it less likely
            out.logprobs = torch.zeros(len(tokens))
            out.top_ids, out.top_logprobs = self._alternatives(tokens, launch.top_logprobs)
        if launch.prompt_logprob_at:
            targets = torch.tensor(launch.prompt_logprob_targets)
            out.prompt_logprobs = torch.zeros(len(targets))
            out.prompt_top_ids, out.prompt_top_logprobs = self._alternatives(targets, max(0, launch.prompt_top_logprobs))
        if launch.pool_spans:
            out.pooled = torch.tensor([[float(n)] * self.hidden for _, n in launch.pool_spans])
        return host_result(out, launch.batch_id)

    def _alternatives(self, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = (tokens[:, None] + torch.arange(k)[None, :]) % self.vocab
        return ids, (0.0 - torch.arange(k, dtype=torch.float32)).expand(len(tokens), k).contiguous()

    def update_lora(self, msg: LoRAMessage) -> None:
        pass  # no weights: an adapter changes nothing the null device computes

    def close(self) -> None:
        pass
