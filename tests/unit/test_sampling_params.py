import pytest

from batonlm.sampling_params import InvalidSamplingParams, SamplingParams


def test_defaults_follow_sglang():
    p = SamplingParams.from_dict(None)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy


@pytest.mark.parametrize(
    "data, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"max_tokens": 5}, "max_tokens"),
    ],
)
def test_bad_values_name_their_field(data, field):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams.from_dict(data)
    assert err.value.field == field


def test_stop_token_ids_checked_against_the_vocabulary():
    p = SamplingParams(stop_token_ids=[5, 700])
    with pytest.raises(InvalidSamplingParams, match=r"\[700\] are outside the vocabulary \[0, 512\)"):
        p.validate(vocab_size=512)
