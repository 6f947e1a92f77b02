"""The transformers fallback (`--model-impl transformers`, or `auto` for an architecture batonlm
has no module for): transformers' own modeling code, with batonlm's paged KV cache plugged in.

transformers' attention modules call the function registered for the model's attention
implementation (`AttentionInterface`); batonlm registers `batonlm`, which hands the layer's
query, key and value to the model runner's `AttentionBackend` for the forward in progress:
the keys and values go into batonlm's pool and each query attends over its request's cached
prefix and the new tokens. An implementation transformers has no mask function for gets no
mask built (the backend applies causality and sliding windows itself), and the model runs
without a transformers cache (`use_cache=False`). So the scheduler, the radix cache, chunked
prefill, retraction, both event loops, speculative decoding and sampling apply unchanged.

A quantized checkpoint with weight-only formats (GPTQ, AWQ, compressed-tensors W4A16 / W8A16)
runs dequantized: transformers' model is built from the config and filled by batonlm's
dequantizing view of the checkpoint (`open_checkpoint`), by the tensors' names, which must be
transformers' own (its checkpoint conversions do not apply); transformers' loader would need the
format's package, and a GPU for most. W8A8 and FP8 checkpoints are refused (their activations are
quantized too: run with float ones, their outputs are not the checkpoint's).

What it does not do: tensor parallelism and DP attention (transformers' layers are whole), the
compiled CPU step and CUDA graphs (the step runs eagerly); attention logit soft-capping (Gemma 2)
only on the torch attention backend. The backend attends with the scale each layer passes; each layer's
sliding window is checked against the one batonlm read from the config on every call, gpt-oss's
sinks (`s_aux`) reach the backend, and any other argument that would change the attention (a
key selection, a positional bias, non-causal) stops the forward: a model that disagrees fails
loudly rather than computing something else.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from batonlm.distributed.group import TPGroup
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.forward_batch import ForwardBatch
from batonlm.model_runner.model_config import ModelConfig
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.weight_loader import LoadStats, checkpoint_files, open_checkpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

IMPLEMENTATION = "batonlm"


class _Forward:
    """The attention backend and batch of the forward in progress (one at a time per process)."""

    attn: AttentionBackend | None = None
    batch: Any = None


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               sliding_window: int | None = None, softcap: float | None = None, s_aux: torch.Tensor | None = None,
               **kwargs: Any):
    """transformers' attention-function signature: q [1, H, T, D], k/v [1, H_kv, T, D] ->
    ([1, T, H, D], None)."""
    attn, batch = _Forward.attn, _Forward.batch
    if attn is None:
        raise RuntimeError("batonlm's attention was called outside a batonlm forward")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    unknown = [k for k, v in kwargs.items() if _changes_attention(k, v)]
    if unknown:
        raise ValueError(f"{type(module).__name__} (layer {layer}) passes {', '.join(sorted(unknown))} to its attention "
                         "function: attention batonlm's paged backends do not compute (a key selection, a "
                         "positional bias, non-causal or other sinks), so this architecture cannot run on the "
                         "transformers fallback")
    # The model's own softmax scale (OPT scales its queries and passes 1.0, Granite a multiplier).
    attn.scale = float(scaling) if scaling is not None else attn.head_dim**-0.5
    if sliding_window != attn.sliding_windows[layer]:
        raise ValueError(f"layer {layer} has sliding window {sliding_window}, batonlm read "
                         f"{attn.sliding_windows[layer]} from the config")
    attn.softcap = float(softcap) if softcap else None
    attn.sinks = s_aux  # gpt-oss's attention sinks: a logit per query head
    heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    out = attn.forward(q, k, v, layer, batch)  # [T, H * D]
    return out.view(1, tokens, heads, dim), None


# What transformers' attention modules pass beside q, k and v, and mean no other attention than
# batonlm's causal paged one (handled above: scaling, sliding_window, softcap, s_aux).
_NEUTRAL = frozenset({"dropout", "position_ids", "cache_position", "output_attentions", "use_cache", "cu_seq_lens_q",
                      "cu_seq_lens_k", "max_length_q", "max_length_k", "layer_idx"})


def _changes_attention(name: str, value: Any) -> bool:
    """An argument that would make the layer's attention something the backends do not compute:
    DeepSeek-V3.2's selected `indices`, `block_indices`, a `position_bias`, other `sinks`, or
    `is_causal=False`; None (and is_causal True) means the default."""
    if name == "is_causal":
        return value is False
    return name not in _NEUTRAL and value is not None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)


class TransformersCausalLM(CausalLM):
    """A transformers `*ForCausalLM` behind batonlm's model interface (one rank)."""

    def __init__(self, cfg: ModelConfig, hf: PreTrainedModel) -> None:
        super().__init__(cfg)
        self.hf = hf
        self.base: nn.Module = hf.base_model
        self.lm_head = hf.get_output_embeddings()
        text = hf.config.get_text_config()
        # What transformers' *ForCausalLM.forward applies to the head's output, where set.
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.logits_divisor = getattr(text, "logits_scaling", None)  # Granite
        self.logit_scale = getattr(text, "logit_scale", None)  # Cohere
        # gpt-oss: its attention layers pass a sink logit per head (`s_aux`)
        self.attention_sinks = any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in hf.modules())

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        _Forward.attn, _Forward.batch = attn, batch
        try:
            out = self.base(input_ids=input_ids[None], position_ids=batch.positions[None].long(), use_cache=False)
        finally:
            _Forward.attn = _Forward.batch = None
        return out.last_hidden_state[0]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # transformers' base model applies its final norm itself

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        logits = self.lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def idle_forward(self, dp_tokens: list[int]) -> None:
        raise NotImplementedError("DP attention needs a native model")


def load_transformers_model(
    cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, tp: TPGroup | None = None,
    mlp_group: TPGroup | None = None,
) -> tuple[CausalLM, LoadStats]:
    """transformers' model of `cfg`'s architecture, its weights read by transformers (whatever
    names and layouts its checkpoint conversions know), on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM

    if (tp is not None and tp.size > 1) or mlp_group is not None:
        raise ValueError("the transformers fallback runs on one rank: tensor parallelism and DP attention "
                         "need a native model")
    _register()
    hf: PreTrainedModel
    if cfg.quantization is None:
        hf = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype, attn_implementation=IMPLEMENTATION)
    else:
        hf = _dequantized(cfg, dtype)
    nn.Module.to(hf, torch.device(device)).eval()  # (transformers' own `to` is typed for its decorators)
    files = checkpoint_files(cfg.path)
    size = sum(f.stat().st_size for f in files)
    logger.info("model %s runs on transformers' modeling code (%s)%s", cfg.architecture, type(hf).__name__,
                f", its {cfg.quantization.description} weights dequantized" if cfg.quantization else "")
    return TransformersCausalLM(cfg, hf), LoadStats(size, size)


def float_config(path: str) -> PretrainedConfig:
    """transformers' config of the checkpoint at `path` without its quantization: the model the
    fallback builds holds float weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _dequantized(cfg: ModelConfig, dtype: torch.dtype) -> PreTrainedModel:
    """transformers' model loaded from the checkpoint's tensors as the dequantizing view reads
    them (transformers' own renames of its checkpoint names apply, as to any state dict)."""
    import transformers

    config = float_config(cfg.path)
    state = {}
    with open_checkpoint(checkpoint_files(cfg.path), cfg.quantization) as ckpt:
        for name in ckpt.names():  # each in the model's dtype as it is read (gpt-oss-20b's experts: 42 GB in bf16)
            t = ckpt.read(name)
            state[name] = t.to(dtype) if t.is_floating_point() else t
    model_class = getattr(transformers, cfg.architecture)  # (the auto class needs a path)
    hf, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                           attn_implementation=IMPLEMENTATION, output_loading_info=True)
    unread = [n for n in info.get("missing_keys", ()) if n in dict(hf.named_parameters())]
    if unread or info.get("unexpected_keys"):
        raise ValueError(f"{cfg.path}: transformers' {cfg.architecture} does not take the quantized checkpoint's "
                         f"tensors as its parameters (missing {sorted(unread)[:3]}, unexpected "
                         f"{sorted(info.get('unexpected_keys', ()))[:3]})")
    return hf
