"""Model facts read once from a Hugging Face directory (`config.json`, `generation_config.json`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batonlm.model_runner.quantization.config import (
    QuantConfig,
    QuantizationError,
    resolve_quantization,
    with_quantize_config,
)
from batonlm.model_runner.rope_config import RopeConfig, RopeConfigError, read_ropes, yarn_mscale
from batonlm.model_runner.text_decoders import MULTIMODAL_TEXT_DECODERS
from batonlm.registries import MODEL_ARCHITECTURES

_FULL = "full_attention"
_SLIDING = "sliding_attention"


class ModelConfigError(ValueError):
    """The model directory or its config cannot be used."""


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values of every head are
    projections of one per-token latent (`kv_lora_rank` features, normalised) plus one rotary key
    shared by the heads (`qk_rope_head_dim`); the KV pool stores those, not per-head K and V."""

    q_lora_rank: int | None  # queries through a low-rank projection (None: one q_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary features stored as interleaved pairs

    @property
    def latent_dim(self) -> int:
        """What one token stores per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model runner and scheduler need to know about a checkpoint."""

    path: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    # Per layer: None for full attention, or the sliding window size.
    sliding_windows: tuple[int | None, ...]
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    # "native": batonlm's model class; "transformers": transformers' modeling code with batonlm's
    # KV cache (models/transformers_fallback.py).
    impl: str = "native"
    # A base model's checkpoint (architecture `XxxModel`, e.g. an embedding model saved as
    # Qwen3Model): the decoder without its LM head, run by `XxxForCausalLM` with the head tied to
    # the embedding; it serves embeddings only.
    embedding_only: bool = False
    # The checkpoint's quantization as batonlm loads it (`--quantization`; None: float weights).
    quantization: QuantConfig | None = None
    # Multi-head latent attention (DeepSeek); None: per-head keys and values.
    mla: MLAConfig | None = None
    # The sliding-window layers' rotary where it is not `rope`'s (Gemma 3's local base).
    local_rope: RopeConfig | None = None
    # A multimodal checkpoint served as its text decoder (MULTIMODAL_TEXT_DECODERS): its architecture.
    text_decoder_of: str | None = None

    # What the KV pool stores and attention reads per token and layer, on a rank of `tp`. MLA
    # stores one latent "head" (replicated on every rank) whose first `kv_lora_rank` features
    # are also the values: attention runs over latents (models/mla.py).
    def kv_heads_per_rank(self, tp: int = 1) -> int:
        return 1 if self.mla else max(1, self.num_kv_heads // tp)

    @property
    def is_moe(self) -> bool:
        """A mixture of experts (some or all of its MLPs)."""
        return any(self.raw.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE's original context: a sequence longer than it is rotated by the long factors
        (layers.RotaryEmbedding's second table); None without LongRoPE (or on transformers' code,
        which switches by itself)."""
        if self.rope.type != "longrope" or self.impl != "native":
            return None
        return self.rope.original_max_position_embeddings

    @property
    def rotary_dim(self) -> int:
        """The leading features of each query and key head that the rotary turns."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def kv_head_dim(self) -> int:
        return self.mla.latent_dim if self.mla else self.head_dim

    @property
    def attn_logit_softcap(self) -> float | None:
        """Gemma 2's cap on attention scores (cap * tanh(s / cap)); None: none."""
        cap = self.raw.get("attn_logit_softcapping")
        return float(cap) if cap else None

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1/sqrt(head dim) (Gemma: of query_pre_attn_scalar); MLA's over
        its query-key dim, times YaRN's `mscale_all_dim` temperature squared."""
        if self.mla is None:  # Gemma's queries scale by query_pre_attn_scalar instead
            return float(self.raw.get("query_pre_attn_scalar") or self.head_dim) ** -0.5
        scale = self.mla.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            mscale = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * mscale * mscale  # transformers' order of operations
        return scale

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(
        cls, path: str | os.PathLike[str], model_impl: str = "auto", quantization: str = "auto"
    ) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) from a model directory.
        `model_impl` (`--model-impl`): native, transformers, or auto (native when batonlm has
        the architecture, else transformers when it can run it); `quantization`
        (`--quantization`): auto (the checkpoint's), none, or a method the checkpoint must have."""
        root = Path(path)
        cfg_file = root / "config.json"
        if not root.is_dir():
            raise ModelConfigError(f"model path {str(root)!r} is not a directory")
        if not cfg_file.is_file():
            raise ModelConfigError(f"model directory {str(root)!r} has no config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_file} is not valid JSON: {e}") from e
        wrapper = _declared_architecture(raw)
        if wrapper in MULTIMODAL_TEXT_DECODERS and model_impl != "transformers":
            raw = _text_decoder_config(root, raw, wrapper)
        else:
            wrapper = None
        # First: an unsupported model may lack the fields read below.
        architecture, impl = _architecture(raw, cfg_file, model_impl)
        if impl == "transformers" and raw.get("kv_lora_rank"):
            native = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
            hint = ("batonlm's native model runs it (--model-impl auto)" if architecture in native else
                    f"batonlm's native latent attention runs {' and '.join(native)} only")
            raise ModelConfigError(
                f"{cfg_file}: {architecture} uses multi-head latent attention (kv_lora_rank), whose keys and values "
                f"differ in size: transformers' modeling code cannot run on batonlm's KV cache; {hint}")
        try:
            raw = with_quantize_config(root, raw)
            quant = resolve_quantization(raw, quantization)
        except QuantizationError as e:
            raise ModelConfigError(f"{cfg_file}: {e}") from None
        if quant is not None and impl != "native" and (quant.act_quant != "none" or quant.online):
            raise ModelConfigError(f"{cfg_file}: a quantized model ({quant.description}) whose activations are "
                                   f"quantized too runs on batonlm's native models only, and {architecture} has none "
                                   f"(--model-impl {model_impl}); on transformers' code weight-only formats run "
                                   "(GPTQ, AWQ, compressed-tensors W4A16 / W8A16), dequantized")
        if quant is not None and quant.method == "mxfp4" and impl == "native":
            raise ModelConfigError(f"{cfg_file}: mxfp4 checkpoints (gpt-oss's MoE experts) run on transformers' "
                                   f"modeling code, dequantized; {architecture} runs on batonlm's native model "
                                   f"(--model-impl {model_impl})")
        embedding_only = architecture != _declared_architecture(raw)
        # transformers' config maps other names (GPT-2's n_embd, ...) to the ones read below.
        text = raw if impl == "native" else _transformers_fields(root, raw)

        def req(key: str) -> Any:
            if key not in text or text[key] is None:
                raise ModelConfigError(f"{cfg_file} lacks the required field {key!r}")
            return text[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = int(text.get("num_key_value_heads") or heads)
        # MLA's rotary dim is its head_dim (as transformers' DeepSeek configs set it).
        head_dim = int(req("qk_rope_head_dim") if text.get("kv_lora_rank") else text.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})"
            )
        num_layers = int(req("num_hidden_layers"))
        model_type = str(text.get("model_type", ""))

        try:
            ropes = read_ropes(text) if impl == "native" else (RopeConfig(), None)  # transformers' own rotary
        except RopeConfigError as e:
            raise ModelConfigError(f"{cfg_file}: {e}") from None
        gen_eos = _generation_eos(root)
        eos = gen_eos if gen_eos is not None else _as_ids(text.get("eos_token_id"))

        return cls(
            path=str(root.resolve()),
            architecture=architecture,
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size") if impl == "native" else
                                  text.get("intermediate_size") or 4 * hidden),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope=ropes[0],
            local_rope=ropes[1],
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            tie_word_embeddings=embedding_only or bool(text.get("tie_word_embeddings", False)),
            hidden_act=str(text.get("hidden_activation") or text.get("hidden_act", "silu")),  # Gemma's name first
            sliding_windows=_sliding_windows(text, model_type, num_layers),
            torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or "float32"),
            eos_token_ids=tuple(eos),
            bos_token_id=text.get("bos_token_id"),
            raw=raw,
            impl=impl,
            embedding_only=embedding_only,
            quantization=quant,
            mla=_mla(text) if impl == "native" else None,
            text_decoder_of=wrapper,
        )


MODEL_IMPLS = ("auto", "native", "transformers")


def _text_decoder_config(root: Path, raw: dict[str, Any], wrapper: str) -> dict[str, Any]:
    """The text config of a multimodal checkpoint, with transformers' defaults filled in (its
    config.json lists only what differs from them), as its causal LM's config."""
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(root).get_text_config().to_dict()
    except Exception as e:  # noqa: BLE001 - transformers' own message says what is wrong
        raise ModelConfigError(f"transformers cannot read {root / 'config.json'}: {e}") from e
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    return {**text, "architectures": [MULTIMODAL_TEXT_DECODERS[wrapper].causal_lm]}


def _declared_architecture(raw: dict[str, Any]) -> str | None:
    archs = raw.get("architectures") or []
    return str(archs[0]) if isinstance(archs, list) and archs else None


def _base_model_of(name: str) -> str | None:
    """The native causal LM whose decoder a base model's architecture (`Qwen3Model`) is."""
    causal = name.removesuffix("Model") + "ForCausalLM"
    return causal if name.endswith("Model") and causal in MODEL_ARCHITECTURES else None


def _architecture(raw: dict[str, Any], cfg_file: Path, model_impl: str) -> tuple[str, str]:
    """The architecture that runs the config's (`architectures[0]`; a base model's causal LM),
    and which implementation runs it."""
    if model_impl not in MODEL_IMPLS:
        raise ModelConfigError(f"model implementation {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    name = _declared_architecture(raw)
    if name is not None and model_impl != "transformers" and (causal := _base_model_of(name)) is not None:
        return causal, "native"
    native = ", ".join(MODEL_ARCHITECTURES.names())
    if name is None:
        raise ModelConfigError(f"{cfg_file}: 'architectures' is missing or empty: the model's class cannot be "
                               f"known (native: {native}; others through transformers)")
    if model_impl == "native" or (model_impl == "auto" and name in MODEL_ARCHITECTURES):
        if name not in MODEL_ARCHITECTURES:
            raise ModelConfigError(f"{cfg_file}: model architecture {name!r} has no native module (native: {native}); "
                                   f"--model-impl auto or transformers runs transformers' modeling code")
        return name, "native"
    why = _transformers_support(name)
    if why is not None:
        raise ModelConfigError(f"{cfg_file}: model architecture {name!r} is not supported: batonlm has no native "
                               f"module for it (native: {native}), and {why}")
    return name, "transformers"


def _transformers_support(architecture: str) -> str | None:
    """None if transformers can run `architecture` with batonlm's attention, else why not."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if not isinstance(cls, type) or not architecture.endswith(("ForCausalLM", "LMHeadModel")):
        return f"transformers {transformers.__version__} has no causal LM class {architecture!r}"
    if not getattr(cls, "_supports_attention_backend", False):
        return f"transformers' {architecture} takes no pluggable attention function (the fallback needs one)"
    return None


# What from_hf reads, taken from transformers' config object for the fallback.
_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
           "hidden_act", "sliding_window", "layer_types", "use_sliding_window", "max_window_layers")


def _transformers_fields(root: Path, raw: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(root).get_text_config()
    except Exception as e:  # noqa: BLE001 - transformers' own message says what is wrong
        raise ModelConfigError(f"transformers cannot read {root / 'config.json'}: {e}") from e
    fields = {k: getattr(text, k) for k in _FIELDS if getattr(text, k, None) is not None}
    return {**raw, **fields}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _generation_eos(root: Path) -> list[int] | None:
    f = root / "generation_config.json"
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{f} is not valid JSON: {e}") from e
    if "eos_token_id" not in data:
        return None
    return _as_ids(data["eos_token_id"])


def _mla(text: dict[str, Any]) -> MLAConfig | None:
    """DeepSeek's attention fields, when the config has a KV latent."""
    if not text.get("kv_lora_rank"):
        return None
    try:
        return MLAConfig(
            q_lora_rank=int(text["q_lora_rank"]) if text.get("q_lora_rank") else None,
            kv_lora_rank=int(text["kv_lora_rank"]),
            qk_nope_head_dim=int(text["qk_nope_head_dim"]),
            qk_rope_head_dim=int(text["qk_rope_head_dim"]),
            v_head_dim=int(text["v_head_dim"]),
            rope_interleave=bool(text.get("rope_interleave", True)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelConfigError(f"config.json: multi-head latent attention (kv_lora_rank) needs {e}") from None


def _sliding_windows(text: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = text.get("sliding_window")
    layer_types = text.get("layer_types")
    if layer_types is None:
        if model_type in ("gemma2", "gemma3_text", "gemma3") and window:  # every `pattern`-th layer global
            pattern = int(text.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6))
            layer_types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
        elif model_type in ("mistral", "mixtral", "phi3"):
            layer_types = [_SLIDING if window else _FULL] * num_layers
        elif model_type == "qwen3_moe":  # every layer, when use_sliding_window
            layer_types = [_SLIDING if window and text.get("use_sliding_window") else _FULL] * num_layers
        elif text.get("use_sliding_window"):
            first = int(text.get("max_window_layers", num_layers))
            layer_types = [_SLIDING if i >= first else _FULL for i in range(num_layers)]
        else:
            layer_types = [_FULL] * num_layers
    if len(layer_types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    out: list[int | None] = []
    for t in layer_types:
        if t == _FULL:
            out.append(None)
        elif t == _SLIDING:
            if not window:
                raise ModelConfigError("a sliding_attention layer needs a sliding_window size")
            out.append(int(window))
        else:
            raise ModelConfigError(f"layer type {t!r} is not supported")
    return tuple(out)
