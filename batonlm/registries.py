"""Every pluggable part of batonlm, by name: model architectures, attention backends, samplers.

Adding one is a line here plus its module. Entries are imported only when used, so the CLI
lists the choices without importing torch, and no module imports another just to register it.
"""

from __future__ import annotations

from typing import Any

from batonlm.registry import LazyRegistry

# Hugging Face `architectures[0]` -> its model class, a subclass of
# batonlm.model_runner.models.base.CausalLM (ModelConfig.from_hf rejects any other name).
MODEL_ARCHITECTURES: LazyRegistry[Any] = LazyRegistry(
    "model architecture",
    {
        "LlamaForCausalLM": "batonlm.model_runner.models.families:LlamaForCausalLM",
        "MistralForCausalLM": "batonlm.model_runner.models.families:MistralForCausalLM",
        "Qwen2ForCausalLM": "batonlm.model_runner.models.families:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "batonlm.model_runner.models.families:Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM": "batonlm.model_runner.models.families:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "batonlm.model_runner.models.families:Qwen3MoeForCausalLM",
        "MixtralForCausalLM": "batonlm.model_runner.models.families:MixtralForCausalLM",
        "Phi3ForCausalLM": "batonlm.model_runner.models.families:Phi3ForCausalLM",
        "Gemma2ForCausalLM": "batonlm.model_runner.models.gemma:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "batonlm.model_runner.models.gemma:Gemma3ForCausalLM",
        "DeepseekV2ForCausalLM": "batonlm.model_runner.models.deepseek:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "batonlm.model_runner.models.deepseek:DeepseekV3ForCausalLM",
    },
)

# Subclasses of batonlm.model_runner.attention.base.AttentionBackend.
ATTENTION_BACKENDS: LazyRegistry[Any] = LazyRegistry(
    "attention backend",
    {
        "torch": "batonlm.model_runner.attention.torch_backend:TorchAttentionBackend",
        "triton": "batonlm.model_runner.attention.triton_backend:TritonAttentionBackend",
    },
)

# Subclasses of batonlm.model_runner.sampler.Sampler.
SAMPLERS: LazyRegistry[Any] = LazyRegistry(
    "sampler",
    {
        "torch": "batonlm.model_runner.sampler:TorchSampler",
        "triton": "batonlm.model_runner.triton_sampler:TritonSampler",
    },
)

# Subclasses of batonlm.tool_calls.parser.ToolCallParser: the formats models write tool calls in.
TOOL_CALL_PARSERS: LazyRegistry[Any] = LazyRegistry(
    "tool-call parser",
    {
        "hermes": "batonlm.tool_calls.formats:HermesParser",
        "llama3": "batonlm.tool_calls.formats:Llama3Parser",
        "mistral": "batonlm.tool_calls.formats:MistralParser",
        "qwen3_coder": "batonlm.tool_calls.qwen3_coder:Qwen3CoderParser",
        "pythonic": "batonlm.tool_calls.pythonic:PythonicParser",
        "deepseek_v3": "batonlm.tool_calls.deepseek:DeepSeekV3Parser",
        "harmony": "batonlm.tool_calls.harmony:HarmonyParser",
    },
)
