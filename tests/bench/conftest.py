from __future__ import annotations

import argparse
import itertools
import json

import pytest
from fake_openai_server import FakeServer

from batonlm.bench.cli import add_bench_arguments, run_bench
from batonlm.bench.datasets import Corpus, load_tokenizer
from batonlm.config import EMBEDDED_MODEL


@pytest.fixture
def fake_server():
    """A fresh fake server per test; tests set its timing and failures before sending."""
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="session")
def corpus(tokenizer) -> Corpus:
    return Corpus(tokenizer)


@pytest.fixture
def run_cli(tmp_path):
    """Run `batonlm bench` in-process with the given flags; returns (exit status, JSON report)."""
    counter = itertools.count()

    def run(*argv: str) -> tuple[int, dict | None]:
        out = tmp_path / f"report{next(counter)}.json"
        parser = argparse.ArgumentParser()
        add_bench_arguments(parser)
        status = run_bench(parser.parse_args(["--disable-progress-bar", "--output-json", str(out), *argv]))
        return status, (json.loads(out.read_text()) if out.exists() else None)

    return run
