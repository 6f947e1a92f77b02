import pytest
from transformers import AutoTokenizer

from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


@pytest.mark.parametrize(
    "prompt, continuation",
    [
        ("Once upon a time", ", there was a little girl named Lily."),
        ("Lily said", " 这是 é ünïcödé 🙂 test"),  # byte-fallback tokens for every non-ASCII char
        ("x", "🙂🙂 ok"),
    ],
)
def test_deltas_are_whole_characters_and_add_up(tok, prompt, continuation):
    p = tok(prompt).input_ids
    out = tok(prompt + continuation).input_ids[len(p):]
    d = IncrementalDetokenizer(tok, p)
    deltas = [d.add([t]) for t in out] + [d.flush()]
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # would raise on a lone surrogate
    want = tok.decode(p + out, skip_special_tokens=True)[len(tok.decode(p, skip_special_tokens=True)):]
    assert "".join(deltas) == want
    assert want == continuation  # leading space kept: what the prompt was followed by


def test_a_truncated_character_is_flushed_as_the_tokenizer_decodes_it(tok):
    p = tok("Hi").input_ids
    smile = tok.convert_tokens_to_ids(["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"])  # U+1F642 in UTF-8
    d = IncrementalDetokenizer(tok, p)
    assert [d.add([t]) for t in smile[:-1]] == ["", "", ""]
    flushed = d.flush()
    assert "\ufffd" in flushed and flushed == tok.decode(p + smile[:-1])[len(tok.decode(p)):]
    d = IncrementalDetokenizer(tok, p)
    assert [d.add([t]) for t in smile] == ["", "", "", "🙂"]


def test_the_window_method_agrees_with_the_stream(tok):
    """Slow tokenizers re-decode a window; fast ones stream. Both give the same deltas."""
    p = tok("Lily said").input_ids
    out = tok("Lily said 这是 é 🙂, a fine day.").input_ids[len(p):]
    fast = IncrementalDetokenizer(tok, p)
    slow = IncrementalDetokenizer(tok, p)
    slow._stream = None
    a = [fast.add([t]) for t in out] + [fast.flush()]
    b = [slow.add([t]) for t in out] + [slow.flush()]
    assert a == b and fast._stream is not None


def test_random_token_streams_never_fail_or_lose_text(tok):
    """Random ids (invalid byte-fallback runs, as random-weight models emit) make the tokenizers
    DecodeStream raise; the detokenizer carries on. ByteFallback decodes a run of byte tokens as
    one unit, so a later invalid byte can turn already valid ones into U+FFFD: no incremental
    decoder can match the full decode there, but no text of a regular token may go missing."""
    import random

    rng = random.Random(0)
    byte_ids = set(range(3, 259))
    for _ in range(50):
        p = [1] + [rng.randrange(3, 512) for _ in range(rng.randint(0, 8))]
        out = [rng.randrange(3, 512) for _ in range(40)]
        d = IncrementalDetokenizer(tok, p)
        text = "".join(d.add([t]) for t in out) + d.flush()
        pos = 0
        for t in out:
            if t not in byte_ids:
                piece = tok.convert_ids_to_tokens(t).replace("▁", " ").strip()
                found = text.find(piece, pos)
                assert found >= 0, f"{piece!r} missing from {text!r}"
                pos = found + len(piece)


def test_a_prompt_ending_inside_a_character(tok):
    """Token ids cut inside a character (a resent output cut by `length`): the completion is
    decode(prompt + output) minus decode(prompt), and no prompt text leaks into it."""
    ids = tok("time 中文 ok", add_special_tokens=False).input_ids
    e4 = tok.convert_tokens_to_ids("<0xE4>")
    cut = ids.index(e4) + 1  # the prompt ends after the first byte of 中
    d = IncrementalDetokenizer(tok, ids[:cut])
    text = "".join(d.add([t]) for t in ids[cut:]) + d.flush()
    full, prefix = tok.decode(ids), tok.decode(ids[:cut])
    assert text == full[len(prefix):] == "文 ok"
