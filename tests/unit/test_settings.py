"""Every server setting is declared once (batonlm/config.py) and the flags, presets, checks and docs
follow from that declaration."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from batonlm.cli import build_parser, parse_serve_args
from batonlm.config import ServerArgs
from batonlm.settings import GROUPS, ConfigError, Declared, declared, derive
from batonlm.settings_docs import FLAGS_DOC, doc_table_mismatches, flag_names, flags_markdown, serve_help
from batonlm.version import __version__

REPO = Path(__file__).resolve().parents[2]
SETTINGS = declared(ServerArgs)


def test_every_field_is_a_declared_setting_with_help_group_and_default():
    assert [d.name for d in SETTINGS] == [f.name for f in dataclasses.fields(ServerArgs)]
    for d in SETTINGS:
        assert d.setting.help.strip(), d.name
        assert d.setting.group in GROUPS, d.name
        shown = d.shown_default()
        assert shown.strip(), d.name
        # A number whose default is "decided later" says what decides it.
        if d.optional and d.default is None and d.kind in (int, float):
            assert d.setting.unset, f"{d.name}: say what None means (unset=...)"
    assert {d.setting.group for d in SETTINGS} == set(GROUPS), "a group with no settings"


def test_the_default_of_each_setting_is_a_value_it_accepts():
    args = ServerArgs()
    for d in SETTINGS:
        d.check(getattr(args, d.name))


def _out_of_range(d: Declared):
    s = d.setting
    if s.choices is not None:
        return "no-such-choice"
    step = 1 if d.kind is int else 0.5
    if s.ge is not None:
        return d.kind(s.ge - step)
    if s.gt is not None:
        return d.kind(s.gt)
    if s.le is not None:
        return d.kind(s.le + step)
    if s.lt is not None:
        return d.kind(s.lt)
    return None


@pytest.mark.parametrize("d", [d for d in SETTINGS if _out_of_range(d) is not None], ids=lambda d: d.name)
def test_a_value_out_of_its_declared_range_is_refused_naming_the_field(d):
    with pytest.raises(ConfigError) as e:
        ServerArgs(**{d.name: _out_of_range(d)})
    assert e.value.field == d.name
    assert "must be" in str(e.value)


@pytest.mark.parametrize("d", SETTINGS, ids=lambda d: d.name)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(d):
    wrong = "12" if d.kind is not str else 12
    with pytest.raises(ConfigError) as e:
        ServerArgs(**{d.name: wrong})
    assert e.value.field == d.name


def test_messages_say_what_a_setting_takes():
    by_name = {d.name: d for d in SETTINGS}
    assert by_name["max_running_requests"].describe() == "a positive integer"
    assert by_name["mem_fraction_static"].describe() == "in (0, 1)"
    assert by_name["port"].describe() == "in 1..65535"
    assert by_name["client_timeout"].describe() == "a positive number of seconds"
    assert by_name["chunked_prefill_size"].describe() == "an integer >= -1"
    assert by_name["compile"].describe() == "one of auto, on, off"


def _serve_parser():
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def test_every_setting_is_a_flag_in_its_group_with_its_default_shown():
    parser = _serve_parser()
    titles = {g.title: g for g in parser._action_groups}
    for d in SETTINGS:
        action = next(a for a in parser._actions if a.dest == d.name)
        assert action in titles[d.setting.group]._group_actions, d.name
        assert action.help.endswith(f"(default: {d.shown_default()})"), d.name
        if not d.setting.positional:
            assert d.flag in action.option_strings
            assert set(d.setting.flags) <= set(action.option_strings)


def test_flags_parse_into_the_settings():
    args = parse_serve_args(["some/model", "--tp", "2", "--dp-size", "1", "--max-n", "3", "--client-timeout", "2.5",
                             "--compile", "off", "--disable-radix-cache", "--schedule-policy", "lpm"])
    assert (args.model, args.tp_size, args.dp_size, args.max_n) == ("some/model", 2, 1, 3)
    assert (args.client_timeout, args.compile, args.disable_radix_cache, args.schedule_policy) == (2.5, "off", True, "lpm")
    assert parse_serve_args([]) == ServerArgs()


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("BATONLM_PORT", "31234")
    monkeypatch.setenv("BATONLM_HOST", "0.0.0.0")
    assert (ServerArgs().port, ServerArgs().host) == (31234, "0.0.0.0")
    assert parse_serve_args([]).port == 31234
    assert parse_serve_args(["--port", "5"]).port == 5
    monkeypatch.setenv("BATONLM_PORT", "http")
    with pytest.raises(ConfigError, match=r"\$BATONLM_PORT must be an integer"):
        ServerArgs()
    # The declared default is what the docs show, whatever the environment says.
    assert next(d for d in SETTINGS if d.name == "port").shown_default() == "30000"


def test_version():
    out = subprocess.run([sys.executable, "-m", "batonlm.cli", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"batonlm {__version__}"


def test_help_is_readable_and_lists_every_flag_with_its_default():
    text = serve_help()
    for d in SETTINGS:
        assert flag_names(d)[0] in text, d.name
    # argparse wraps lines, so compare without the wrapping.
    flat = " ".join(text.split())
    for d in SETTINGS:
        assert f"(default: {' '.join(d.shown_default().split())})" in flat.replace("- ", "-"), d.name
    for group in GROUPS:
        assert f"\n{group}:\n" in text


def test_docs_flags_page_is_current():
    assert FLAGS_DOC.read_text() == flags_markdown(), "run `python -m batonlm.settings_docs` (make docs)"


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_flag_tables_in_the_docs_state_the_declared_defaults(doc):
    assert doc_table_mismatches((REPO / doc).read_text()) == []


def test_doc_table_check_catches_a_drifted_default():
    table = "| flag | default | what |\n|---|---|---|\n| `--chunked-prefill-size` | 8192 GPU, 256 CPU | x |\n"
    (problem,) = doc_table_mismatches(table)
    assert "8192 on a GPU, 128 on the CPU" in problem
    assert doc_table_mismatches("| flag | default |\n|---|---|\n| `--no-such-flag` | 1 |\n")


def test_derived_records_take_settings_by_name():
    @dataclasses.dataclass(frozen=True)
    class Record:
        max_running_requests: int
        num_draft_tokens: int
        resolved: str
        grammar_whitespace: str = "bounded"

    args = ServerArgs(max_running_requests=7, speculative_num_draft_tokens=3, grammar_whitespace="any")
    rec = derive(Record, args, resolved="x", num_draft_tokens=args.speculative_num_draft_tokens)
    assert rec == Record(7, 3, "x", "any")
    spec = derive(Record, args, prefix="speculative_", max_running_requests=1, resolved="y")
    assert spec.num_draft_tokens == 3
    with pytest.raises(TypeError, match="no field"):
        derive(Record, args, resolved="x", nonsense=1)


def test_a_directory_is_served_under_its_name(tmp_path):
    model = tmp_path / "Qwen2.5-0.5B-Instruct"
    model.mkdir()
    assert ServerArgs(model=str(model)).model_name == "Qwen2.5-0.5B-Instruct"
    assert ServerArgs(model=str(model) + "/").model_name == "Qwen2.5-0.5B-Instruct"
    assert ServerArgs(model=str(model), served_model_name="qwen").model_name == "qwen"
    assert ServerArgs(model="Qwen/Qwen2.5-0.5B-Instruct").model_name == "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id
    assert ServerArgs().model_name == "stories260K"
