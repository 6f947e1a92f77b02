"""`batonlm serve --config FILE`: presets load, the command line overrides them, mistakes are named."""

from pathlib import Path

import pytest

from batonlm.cli import parse_serve_args
from batonlm.config import EMBEDDED_MODEL, ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["default", "gpu-small", "latency", "throughput"])
def test_presets_load(name):
    args = parse_serve_args(["--config", str(CONFIGS / f"{name}.yaml")])
    assert args.port == 30000


def test_preset_values():
    gpu = parse_serve_args(["--config", str(CONFIGS / "gpu-small.yaml")])
    assert (gpu.model, gpu.device, gpu.dtype, gpu.host) == ("Qwen/Qwen2.5-0.5B-Instruct", "cuda", "bfloat16", "0.0.0.0")
    default = parse_serve_args(["--config", str(CONFIGS / "default.yaml")])
    assert default.model == EMBEDDED_MODEL and default.device == "cpu"


def test_command_line_overrides_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("port: 31000\nmax-running-requests: 8\ndisable-overlap: true\nmodel: /some/model\n")
    args = parse_serve_args(["--config", str(f)])
    assert (args.port, args.max_running_requests, args.disable_overlap, args.model) == (31000, 8, True, "/some/model")
    args = parse_serve_args(["/other/model", "--config", str(f), "--port", "32000", "--no-disable-overlap"])
    assert (args.port, args.max_running_requests, args.disable_overlap, args.model) == (32000, 8, False, "/other/model")


def test_underscores_and_dashes_both_work(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_running_requests: 3\nmax-prefill-tokens: 99\n")
    args = parse_serve_args(["--config", str(f)])
    assert (args.max_running_requests, args.max_prefill_tokens) == (3, 99)


@pytest.mark.parametrize(
    "content, key, words",
    [
        ("max-runing-requests: 4\n", "max-runing-requests", "unknown key"),
        ("port: abc\n", "port", "expected an integer"),
        ("port: 70000\n", "port", "1..65535"),
        ("disable-overlap: maybe\n", "disable-overlap", "true or false"),
        ("dtype: float64\n", "dtype", "must be one of"),
        ("max-running-requests: 0\n", "max_running_requests", "positive"),
        ("mem-fraction-static: 2\n", "mem_fraction_static", "(0, 1)"),
        ("- just\n- a list\n", "config", "mapping"),
        ("port: [\n", "config", "not valid YAML"),
    ],
)
def test_mistakes_name_the_key(tmp_path, content, key, words):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    with pytest.raises(ConfigError) as err:
        parse_serve_args(["--config", str(f)])
    assert err.value.field == key
    assert words in str(err.value)
    if key != "config":
        assert str(f) in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_serve_args(["--config", "/no/such/file.yaml"])
