"""The main process loads the tokenizer without importing torch (AutoTokenizer would: its config
machinery imports it, ~250 MB of a process that computes no tensor), and gets what AutoTokenizer
gives: the class the directory names (its fast variant first), the same ids, the same chat
rendering. A directory naming no class transformers has falls back to AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from batonlm.tokenizer_manager.tokenizer import declared_class, load_tokenizer


def test_the_main_process_loads_the_tokenizer_without_torch(stories_path):
    code = ("import sys; from batonlm.tokenizer_manager.tokenizer import load_tokenizer; "
            f"t = load_tokenizer({stories_path!r}); print(type(t).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["LlamaTokenizer", "False"]


def test_it_is_the_tokenizer_auto_tokenizer_gives(stories_path, tmp_path):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(stories_path), AutoTokenizer.from_pretrained(stories_path)
    assert type(ours) is type(auto)
    text = "Once upon a time, Lily saw a big dog. \n\n It was 3 o'clock!"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.decode(auto(text).input_ids) == auto.decode(auto(text).input_ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    # No class named, or one transformers does not export: AutoTokenizer's choice.
    for f in ("tokenizer.json", "tokenizer.model", "special_tokens_map.json"):
        shutil.copy(f"{stories_path}/{f}", tmp_path / f)
    config = json.loads(open(f"{stories_path}/tokenizer_config.json").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    assert declared_class(str(tmp_path)) is None
    del config["tokenizer_class"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert declared_class(str(tmp_path)) is None
    assert load_tokenizer(str(tmp_path))(text).input_ids == auto(text).input_ids
