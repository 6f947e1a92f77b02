"""Stop strings over a stream of text deltas: trimmed, never leaked in part, across any split."""

import random

import pytest

from batonlm.tokenizer_manager.stop_strings import StopStringMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], str, bool]:
    """(what each feed released, what flush released, stopped)."""
    m = StopStringMatcher(stops)
    released = [m.feed(d) for d in deltas]
    return released, m.flush(), m.stopped


def test_a_stop_inside_one_delta_cuts_there():
    released, tail, stopped = run(["END"], ["abc END def"])
    assert released == ["abc "] and tail == "" and stopped


def test_a_stop_across_deltas_is_held_back_then_dropped():
    released, tail, stopped = run(["\n\n"], ["one\n", "\ntwo"])
    assert released == ["one", ""] and stopped and tail == ""


def test_a_partial_match_is_released_once_it_cannot_be_a_stop():
    released, tail, stopped = run(["STOP"], ["ab ST", "O", "ne more"])
    assert released == ["ab ", "", "STOne more"] and not stopped and tail == ""


def test_flush_releases_what_was_held_when_generation_ends():
    released, tail, stopped = run(["STOP"], ["go ST"])
    assert released == ["go "] and tail == "ST" and not stopped


def test_the_earliest_of_several_stops_wins_and_nothing_follows():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"
    assert m.stopped and m.feed("more") == "" and m.flush() == ""


def test_no_stops_pass_everything_and_empty_stops_are_ignored():
    assert run([], ["a", "b"]) == (["a", "b"], "", False)
    assert run([""], ["a"]) == (["a"], "", False)


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_the_text_up_to_the_first_stop(seed):
    rng = random.Random(seed)
    alphabet = "ab \n"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    released, tail, stopped = run(stops, deltas)
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    expected = text[:first] if first >= 0 else text
    assert "".join(released) + tail == expected
    assert stopped == (first >= 0)
    so_far = ""
    for r in released:  # no released prefix ever shows a stop string
        so_far += r
        assert not any(s in so_far for s in stops)


def test_unarmed_text_passes_and_matching_starts_after_it():
    m = StopStringMatcher([","])
    assert m.feed("Once, upon", armed=False) == "Once, upon"  # under min_tokens: a stop string does not count
    assert not m.stopped
    assert m.feed(" a time, there", armed=True) == " a time"
    assert m.stopped


def test_min_tokens_hold_off_stop_strings_in_a_request(stories_path):
    """`min_tokens: 20` with `stop: [","]`: the comma in the first tokens does not end the
    request; the first comma from the 20th token on does (vLLM's rule)."""
    from batonlm.ipc.messages import TokenOutput
    from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer
    from batonlm.tokenizer_manager.request_state import RequestState
    from batonlm.tokenizer_manager.tokenizer import load_tokenizer

    tok = load_tokenizer(stories_path)
    prompt = tok("Once upon a time").input_ids
    story = tok(", there was a little girl, and she was happy, and she played, and she ran, and she sang",
                add_special_tokens=False).input_ids
    assert len(story) > 25

    def run(min_tokens: int) -> tuple[str, int]:
        state = RequestState("r", IncrementalDetokenizer(tok, prompt), StopStringMatcher([","]), len(prompt),
                             min_tokens=min_tokens)
        text = ""
        for i, t in enumerate(story):
            chunk, _ = state.apply(TokenOutput("r", [t], None), None)
            text += chunk.text
            if chunk.finish_reason is not None:
                return text, i + 1
        return text, len(story)

    # The reference: each token's text with no stop strings, and the first comma from the
    # min_tokens-th token on.
    plain = RequestState("p", IncrementalDetokenizer(tok, prompt), StopStringMatcher([]), len(prompt))
    deltas = [plain.apply(TokenOutput("p", [t], None), None)[0].text for t in story]

    def expected(min_tokens: int) -> tuple[str, int]:
        n = next(i + 1 for i, d in enumerate(deltas) if "," in d and i + 1 >= max(1, min_tokens))
        return "".join(deltas[: n - 1]) + deltas[n - 1].split(",")[0], n

    assert run(0) == expected(0)
    text, n = run(20)
    assert (text, n) == expected(20)
    assert n >= 20 and "," in text  # the commas before the 20th token did not stop it
