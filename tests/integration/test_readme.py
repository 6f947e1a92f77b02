"""Every command and snippet of the README runs, against a live server where it needs one."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from live_helpers import BATONLM

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
README_URL = "http://127.0.0.1:30000"


def blocks(lang: str, containing: str) -> list[str]:
    found = [body for kind, body in BLOCKS if kind == lang and containing in body]
    assert found, f"no ```{lang} block with {containing!r} in the README"
    return found


def commands(block: str) -> list[str]:
    """Shell commands of a block: comments dropped, continuation lines joined."""
    text = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def words(text: str) -> int:
    return len(re.findall(r"[A-Za-z]+", text))


@pytest.fixture(scope="module")
def readme_server(server):
    """The server exactly as the README's first command starts it: the session server, which is
    started with the console script and no other argument."""
    install_and_serve = commands(blocks("bash", "pip install")[0])[0]
    serve = install_and_serve.split("&&")[1].split()
    assert serve == ["batonlm", "serve"]
    assert server.proc.args[: -2] == [BATONLM, *serve[1:]] and server.proc.args[-2] == "--port"
    return server


def run(cmd: str, url: str | None = None, timeout: float = 120) -> str:
    if url is not None:
        cmd = cmd.replace(README_URL, url)
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                         env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert out.returncode == 0, f"{cmd}\nstdout: {out.stdout}\nstderr: {out.stderr}"
    return out.stdout


def test_setup_commands_are_what_ci_runs():
    install_and_serve, test_cmd = commands(blocks("bash", "pip install")[0])
    assert install_and_serve.startswith('pip install "torch==2.13.0" -e . && ')
    ci = (ROOT / ".ci" / "run").read_text()
    install, test = test_cmd.split(" && ")
    assert 'pip install --quiet "torch==2.13.0"' in ci  # torch first, the CPU build from disk
    assert install.replace("pip install", "pip install --quiet") in ci
    assert ci.rstrip().splitlines()[-1] == test == "make test"


def test_curl_streams_story_text(readme_server):
    (cmd,) = commands(blocks("bash", "curl -N")[0])
    out = run(cmd, readme_server.base_url)
    events = [line for line in out.splitlines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    import json

    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert words(text) >= 10, text


def test_openai_client_snippet(readme_server):
    code = blocks("python", "from openai import OpenAI")[0].replace(README_URL, readme_server.base_url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert words(out.stdout) >= 10, out.stdout


def test_structured_output_snippet_saved_as_a_script(readme_server, tmp_path):
    import ast

    script = tmp_path / "structured.py"
    script.write_text(blocks("python", "response_format")[0].replace(README_URL, readme_server.base_url))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    person, answer = out.stdout.strip().splitlines()
    person = ast.literal_eval(person)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and 1 <= person["age"] <= 99
    assert answer in ("yes", "no")


def test_engine_snippet_saved_as_a_script(tmp_path):
    """As a user runs it: saved to a file, `python my_script.py` (the spawned scheduler must not
    re-run the script's top level, which creates the Engine)."""
    script = tmp_path / "my_script.py"
    script.write_text(blocks("python", "batonlm.Engine()")[0])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(", there was a little girl named Lily."), out.stdout
    assert out.stdout.splitlines()[-1] == "2 16"  # two embeddings of 16 values


def test_engine_snippet_from_stdin_inside_a_running_event_loop(tmp_path):
    """As a notebook runs it: no main file, and an asyncio loop already running in the thread."""
    snippet = blocks("python", "batonlm.Engine()")[0]
    code = "import asyncio\n\nasync def cell():\n" + "".join(f"    {line}\n" for line in snippet.splitlines())
    code += "\nasyncio.run(cell())\n"
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(", there was a little girl named Lily."), out.stdout


def test_every_serve_command_parses():
    from batonlm.cli import parse_serve_args

    lines = [c for _, b in BLOCKS for c in commands(b) if c.startswith("batonlm serve")]
    assert len(lines) >= 3
    for line in lines:
        args = parse_serve_args(shlex.split(line)[2:])
        assert args.port in (30000, 30001)
    preset = parse_serve_args(shlex.split("batonlm serve --config configs/latency.yaml --port 30001")[2:])
    assert preset.enable_mixed_batch and preset.max_running_requests == 16 and preset.port == 30001


def test_docker_commands_match_the_dockerfile():
    readme = commands(blocks("bash", "docker build")[0])
    docker_readme = (ROOT / "docker" / "README.md").read_text()
    for cmd in readme:
        assert cmd in docker_readme, f"{cmd!r} differs from docker/README.md"
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "-f docker/Dockerfile" in readme[0]
    assert "-p 30000:30000" in readme[1] and "EXPOSE 30000" in dockerfile
    volume = re.search(r"-v \S+:(\S+)", readme[1]).group(1)
    assert f'VOLUME ["{volume}"]' in dockerfile


def test_benchmark_commands_run(readme_server, tmp_path):
    overlap, bench = commands(blocks("bash", "benchmarks/overlap.py")[0])
    out = run(f"{overlap} --concurrency 2 --new-tokens 8 --rounds 1 --output-json {tmp_path}/o.json", timeout=300)
    assert "hidden" in out and (tmp_path / "o.json").exists()
    out = run(f"{bench} --num-prompts 4 --random-input-len 16 --random-output-len 8 --disable-progress-bar "
              f"--output-json {tmp_path}/b.json", readme_server.base_url)
    import json

    assert json.loads((tmp_path / "b.json").read_text())["summary"]["completed"] == 4


def test_make_help_lists_the_targets():
    out = run("make help")
    for target in ("install", "run", "test", "test-all", "test-quick", "lint", "docs", "bench", "docker"):
        assert f"make {target}" in out


def test_the_api_docs_examples_run(readme_server):
    """Each curl example of docs/api.md answers in its route's shape (a field with its value,
    or None: a field there)."""
    import json

    api = (ROOT / "docs" / "api.md").read_text()
    examples = [body for kind, body in re.findall(r"```(\w*)\n(.*?)```", api, re.S) if kind == "bash"]
    shapes = {"/v1/chat/completions": ("object", "chat.completion"), "/v1/completions": ("object", "text_completion"),
              "/v1/responses/input_tokens": ("object", "response.input_tokens"), "/v1/responses": ("object", "response"),
              "/v1/messages/count_tokens": ("input_tokens", None), "/v1/messages": ("type", "message"),
              "/v1/embeddings": ("object", "list"), "/generate": ("meta_info", None), "/tokenize": ("tokens", None),
              "/detokenize": ("prompt", None), "/tokenizer_info": ("tokenizer_class", None),
              "/v1/models": ("object", "list"), "/v1/models/stories260K": ("object", "model"),
              "/health": ("status", "ok"), "/version": ("version", None),
              "/flush_cache": ("status", "ok")}
    seen = set()
    for block in examples:
        (cmd,) = commands(block)
        answer = json.loads(run(cmd, readme_server.base_url))
        route = max((r for r in shapes if r in cmd), key=len)
        key, value = shapes[route]
        assert key in answer and (value is None or answer[key] == value), (route, answer)
        seen.add(route)
    assert seen == set(shapes)  # every route has its example
