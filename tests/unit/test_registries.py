"""Registries drive the choices the CLI and config offer, and every entry resolves."""

import pytest

from batonlm.cli import build_parser
from batonlm.config import ATTENTION_BACKEND_CHOICES, SAMPLER_CHOICES, ConfigError, ServerArgs
from batonlm.model_runner.attention.base import AttentionBackend
from batonlm.model_runner.models.base import CausalLM
from batonlm.model_runner.sampler import Sampler
from batonlm.registries import ATTENTION_BACKENDS, MODEL_ARCHITECTURES, SAMPLERS
from batonlm.registry import LazyRegistry, UnknownEntry


def _choices(flag: str) -> list[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return list(next(a for a in serve._actions if flag in a.option_strings).choices)


def test_cli_choices_are_the_registries_keys():
    assert list(SAMPLER_CHOICES) == ["auto", *SAMPLERS.names()]
    assert list(ATTENTION_BACKEND_CHOICES) == ["auto", *ATTENTION_BACKENDS.names()]
    assert _choices("--sampler") == list(SAMPLER_CHOICES)
    assert _choices("--attention-backend") == list(ATTENTION_BACKEND_CHOICES)


def test_config_rejects_a_name_not_in_the_registry():
    with pytest.raises(ConfigError, match="sampler"):
        ServerArgs(sampler="fast")


def test_every_entry_resolves_to_its_kind():
    for name in MODEL_ARCHITECTURES:
        assert issubclass(MODEL_ARCHITECTURES[name], CausalLM)
    for name in ATTENTION_BACKENDS:
        assert issubclass(ATTENTION_BACKENDS[name], AttentionBackend)
    for name in SAMPLERS:
        assert issubclass(SAMPLERS[name], Sampler)


def test_lazy_registry_imports_on_first_use_and_names_the_known():
    reg = LazyRegistry("widget", {"json": "json:dumps"})
    assert reg.names() == ("json",) and "json" in reg and "xml" not in reg
    import json

    assert reg["json"] is json.dumps
    with pytest.raises(UnknownEntry, match=r"widget 'xml' is not supported \(supported: json\)"):
        reg["xml"]


def test_readme_and_models_doc_list_every_architecture():
    """The README's supported list and docs/models.md's table name exactly the registered
    architectures."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    para = readme[readme.index("Supported architectures:"):].split("\n\n")[0]
    registered = set(MODEL_ARCHITECTURES.names())
    assert set(re.findall(r"`(\w+ForCausalLM)`", para)) == registered
    table = [line for line in (root / "docs" / "models.md").read_text().splitlines() if line.startswith("| `")]
    assert {re.match(r"\| `(\w+)`", line).group(1) for line in table if "ForCausalLM" in line} == registered
