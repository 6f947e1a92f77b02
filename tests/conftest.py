import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Most tests start engines that need no compiled decode step (it costs seconds to build); the
# tests of that step ask for it, and `BATONLM_COMPILE=on make test` runs everything compiled.
os.environ.setdefault("BATONLM_COMPILE", "off")
# Servers and workers of tests running side by side would all pin their workers to the last core
# (cpu_affinity.py): the tests of it ask for it.
os.environ.setdefault("BATONLM_CPU_AFFINITY", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA the Triton kernels run interpreted (TESTING.md). Set here, first: triton reads it
# when it is imported, and any test module may import it at collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from batonlm import spawn  # noqa: E402
from batonlm.config import EMBEDDED_MODEL  # noqa: E402

# The harness builds a scheduler in this process for most integration tests: its device worker is
# forked from a server process that imported torch once, instead of importing it anew (about a
# second per start). Servers and engines the tests start use the default, spawn.
spawn.set_worker_start_method("forkserver")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stories_path() -> str:
    return EMBEDDED_MODEL


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Tiny random-weight models of every test family (configs/test-models/*.json), saved with
    save_pretrained (fp32). Each exercises a family option (configs/test-models/README.md)."""
    from helpers import TEST_FAMILIES, build_tiny_model, copy_tokenizer

    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for family in TEST_FAMILIES:
        path = root / family
        build_tiny_model(family, path)
        copy_tokenizer(path)
        out[family] = str(path)
    return out
