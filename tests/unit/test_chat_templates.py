"""Each family's chat format through batonlm's rendering (tokenizer_manager/chat_template.py)
equals transformers' `apply_chat_template`: one BOS where the template writes it (never a second
from the tokenizer), every role marker a single special token, the generation prompt last. The
templates (tests/data/chat_templates/) are written in each family's turn format: Llama 3's
headers, Qwen's ChatML with its default system prompt, Mistral's [INST] with strict
alternation, Gemma's turns without a system role, Phi-3's role tags, DeepSeek-V3's full-width
markers. A template's refusal reaches the client as a 400 naming `messages`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from batonlm.server.errors import APIError
from batonlm.server.openai_common import render_chat
from batonlm.tokenizer_manager.chat_template import apply_chat_template

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "chat_templates"
# template -> (role markers the family's tokenizer has as special tokens, BOS, EOS, generation prompt)
FAMILIES = {
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>",
               "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen2": (["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_start|>assistant\n"),
    "mistral": (["[INST]", "[/INST]"], "<s>", "</s>", "[/INST]"),
    "gemma": (["<start_of_turn>", "<end_of_turn>"], "<s>", "<end_of_turn>", "<start_of_turn>model\n"),
    "phi3": (["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], None, "<|end|>", "<|assistant|>\n"),
    "deepseek_v3": (["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜Assistant｜>"),
}
CONVERSATION = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "Tell me about a cat."},
    {"role": "assistant", "content": "The cat sat on the mat."},
    {"role": "user", "content": "And then?"},
]


def _tokenizer(stories_path: str, family: str, tmp_path: Path):
    """The embedded model's tokenizer with the family's special tokens and template, saved and
    read back as a model directory's would be."""
    from transformers import AutoTokenizer

    markers, bos, eos, _ = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(stories_path)
    tok.add_special_tokens({"additional_special_tokens": markers})
    if bos is not None:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    tok.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def _messages(family: str) -> list[dict]:
    return CONVERSATION[1:] if family == "gemma" else CONVERSATION  # Gemma has no system role


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_renders_as_transformers_does(stories_path, tmp_path, family):
    tok = _tokenizer(stories_path, family, tmp_path)
    markers, bos, _, generation_prompt = FAMILIES[family]
    messages = _messages(family)
    ids = apply_chat_template(tok, messages)
    assert ids == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    marker_ids = set(tok.convert_tokens_to_ids(markers))
    assert len(marker_ids) == len(markers) and tok.unk_token_id not in marker_ids
    used = [i for i in ids if i in marker_ids]
    assert used, "no role marker became a special token"
    if bos is not None:  # written once by the template, never again by the tokenizer
        assert ids[0] == tok.convert_tokens_to_ids(bos) and ids.count(ids[0]) == 1
    else:
        assert ids[0] != tok.bos_token_id
    tail = tok(generation_prompt, add_special_tokens=False).input_ids
    assert ids[-len(tail):] == tail
    assert tok.decode(ids).count("And then?") == 1
    without = apply_chat_template(tok, messages, add_generation_prompt=False)
    assert ids[: len(without)] == without  # the generation prompt only appends (Mistral's: nothing)


@pytest.mark.parametrize("family, messages, why", [
    ("gemma", CONVERSATION, "System role not supported"),
    ("mistral", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "must alternate"),
])
def test_a_template_refusal_is_a_400_naming_messages(stories_path, tmp_path, family, messages, why):
    state = SimpleNamespace(tokenizer=_tokenizer(stories_path, family, tmp_path))
    with pytest.raises(APIError) as e:
        asyncio.run(render_chat(state, messages))
    assert e.value.status == 400 and e.value.param == "messages" and why in e.value.message
