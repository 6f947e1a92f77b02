"""The usual start-up mistakes give one clear line and a non-zero exit, not a traceback."""

import socket
import subprocess
import sys

import pytest


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batonlm", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})


def assert_clean_error(out: subprocess.CompletedProcess, *words: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "Traceback" not in text, text
    for w in words:
        assert w in text, text


def test_model_path_that_does_not_exist():
    assert_clean_error(serve("/no/such/model"), "model path '/no/such/model' does not exist")


def test_hub_id_while_offline():
    assert_clean_error(serve("someone/some-model"), "'someone/some-model'", "could not be fetched", "HF_HUB_OFFLINE")


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_clean_error(serve("--port", str(port)), f"port {port} on 127.0.0.1 is already in use")


def test_device_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_clean_error(serve("--device", "cuda"), "no CUDA device is available")


def test_unsupported_dtype_and_bad_flags():
    assert_clean_error(serve("--dtype", "float64"), "invalid choice: 'float64'")
    assert_clean_error(serve("--max-running-requests", "0"), "max_running_requests", "positive")


def test_broken_checkpoint(tmp_path, stories_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(stories_path, d)
    (d / "model.safetensors").unlink()
    assert_clean_error(serve(str(d)), "could not be started", "no safetensors weights")


def test_a_tokenizer_that_does_not_load_stops_the_start(tmp_path):
    # The tokenizer loads while the scheduler starts: its failure cancels the start (exit code 2,
    # one line, the model never reported ready).
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    out = serve("--tokenizer", str(tmp_path))
    assert_clean_error(out, "could not load a tokenizer from", str(tmp_path))
    assert out.returncode == 2 and "ready on" not in out.stdout + out.stderr


def test_an_unsupported_quantization_config(tmp_path, stories_path):
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(stories_path, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "hqq"}}))
    assert_clean_error(serve(str(d)), "quantization method 'hqq'", "fp8, compressed-tensors, gptq, awq, modelopt, bitsandbytes")
