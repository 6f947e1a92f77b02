"""lm-evaluation-harness end to end: `lm_eval --model local-completions` against a live server
runs a loglikelihood task (multiple choice, scored through echo + logprobs) and a
generate_until task, and agrees with lm-eval's own `hf` backend on the same fp32 weights: every
loglikelihood within 1e-4, the same is-greedy flags, the same greedy generations.

The tasks ship in tests/data/lm_eval (no download; their data paths are relative to the
repository root, where lm_eval runs, as docs/lm-eval.md and the README say). lm-eval's default
tokenizer for an API model is the server's own (/tokenizer_info, /tokenize), which encodes
without BOS; the hf backend is told the same (add_bos_token=False), so both score identical
token sequences."""

from __future__ import annotations

import glob
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("batonlm_stories_choice", "batonlm_stories_continue")


def lm_eval_samples(out: Path) -> dict[str, list[dict]]:
    """The logged samples of an lm_eval run per task, in document order."""
    samples = {}
    for task in TASKS:
        (path,) = glob.glob(f"{out}/*/samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])
    return samples


def lm_eval_env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "HF_HOME": str(tmp / "hf_home"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def _lm_eval(tmp: Path, runs: dict[str, list[str]]) -> dict[str, dict[str, list[dict]]]:
    """Run lm_eval command lines (name -> argv after `lm_eval`) from the repository root, all at
    once; the logged samples of each."""
    procs = {}
    for name, argv in runs.items():
        cmd = [sys.executable, "-m", "lm_eval", *argv, "--output_path", str(tmp / name), "--log_samples"]
        log = open(tmp / f"{name}.log", "w")  # a file, not a pipe: neither run waits on a full pipe
        procs[name] = (subprocess.Popen(cmd, env=lm_eval_env(tmp), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log)
    for name, (proc, log) in procs.items():
        proc.wait(timeout=600)
        log.close()
        assert proc.returncode == 0, (tmp / f"{name}.log").read_text()[-6000:]
    return {name: lm_eval_samples(tmp / name) for name in runs}


def readme_command(base_url: str) -> list[str]:
    """The README's lm-eval command (after `lm_eval`), pointed at `base_url`."""
    from test_readme import README_URL, blocks, commands

    install, cmd = commands(blocks("bash", "lm_eval --model local-completions")[0])
    assert install.startswith("pip install") and "lm-eval" in install
    argv = shlex.split(cmd.replace(README_URL, base_url))
    assert argv[0] == "lm_eval"
    return argv[1:]


def test_lm_eval_local_completions_matches_the_hf_backend(server, tmp_path, stories_path):
    """The API run is the README's command as written, against the server as the README starts it
    (the session server); lm-eval's hf backend runs beside it."""
    runs = _lm_eval(tmp_path, {
        "api": readme_command(server.base_url),
        "hf": ["--model", "hf", "--model_args", f"pretrained={stories_path},dtype=float32,add_bos_token=False",
               "--device", "cpu", "--tasks", ",".join(TASKS), "--include_path", "tests/data/lm_eval"],
    })
    api, hf = runs["api"], runs["hf"]

    choice_api, choice_hf = api["batonlm_stories_choice"], hf["batonlm_stories_choice"]
    assert len(choice_api) == len(choice_hf) == 10
    compared = 0
    for a, h in zip(choice_api, choice_hf, strict=True):
        assert a["arguments"] == h["arguments"]
        for (ra,), (rh,) in zip(a["resps"], h["resps"], strict=True):
            assert abs(float(ra[0]) - float(rh[0])) <= 1e-4, (a["doc_id"], ra, rh)
            assert ra[1] == rh[1], (a["doc_id"], ra, rh)
            compared += 1
    assert compared == 40
    # The loglikelihoods mean something: the model prefers the sensible ending (chance is 1/4).
    assert sum(a["acc"] for a in choice_api) >= 8

    gen_api, gen_hf = api["batonlm_stories_continue"], hf["batonlm_stories_continue"]
    assert len(gen_api) == len(gen_hf) == 6
    for a, h in zip(gen_api, gen_hf, strict=True):
        text_api, text_hf = a["resps"][0][0], h["resps"][0][0]
        assert text_api.strip() and len(text_api) > 5
        # hf decodes the continuation's tokens alone, which drops sentencepiece's leading space;
        # the server decodes them after the prompt (" She ...", what the text really continues with).
        assert text_api.lstrip(" ") == text_hf, (text_api, text_hf)
