"""Registries drive the choices the CLI and config offer."""

from batonlm.config import ATTENTION_BACKEND_CHOICES, SAMPLER_CHOICES
from batonlm.model_runner.attention.base import attention_backend_names
from batonlm.model_runner.models.registry import MODEL_FAMILIES
from batonlm.model_runner.sampler import sampler_names


def test_cli_choices_are_the_registries_keys():
    assert list(SAMPLER_CHOICES) == ["auto", *sampler_names()]
    assert list(ATTENTION_BACKEND_CHOICES) == ["auto", *attention_backend_names()]


def test_model_families():
    assert sorted(MODEL_FAMILIES) == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
