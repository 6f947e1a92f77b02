import math

import msgspec
import pytest

from batonlm.ipc import codec
from batonlm.ipc.messages import GenerateRequest
from batonlm.sampling_params import MAX_INT32, InvalidSamplingParams, SamplingParams, field_range


def test_defaults_follow_sglang():
    p = SamplingParams.from_dict(None)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy


@pytest.mark.parametrize(
    "data, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),  # once overflowed the device's int64 table and killed the server
        ({"top_k": 2**64 + 1}, "top_k"),
        ({"min_new_tokens": 2**63}, "min_new_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": MAX_INT32 + 1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),  # numbers are numbers, not strings
        ({"top_k": "8"}, "top_k"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 5}, "max_tokens"),
    ],
)
def test_bad_values_name_their_field(data, field):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams.from_dict(data)
    assert err.value.field == field


def test_in_range_values_and_json_keys():
    p = SamplingParams.from_dict(
        {"temperature": 2, "top_k": 0, "seed": -(2**63), "logit_bias": {"7": -100}, "logprobs": 20}
    )
    assert p.temperature == 2.0 and p.top_k == 0 and p.logit_bias == {7: -100.0}


def test_ranges_are_stated_once_and_read_by_the_request_models():
    assert field_range("temperature") == {"ge": 0.0, "le": 2.0}
    assert field_range("top_p") == {"gt": 0.0, "le": 1.0}
    assert field_range("seed") == {"ge": -(2**63), "le": 2**63 - 1}  # an optional field
    from batonlm.server.protocol import ChatCompletionRequest

    schema = ChatCompletionRequest.model_json_schema()["properties"]
    assert (schema["temperature"]["minimum"], schema["temperature"]["maximum"]) == (0.0, 2.0)


def test_the_scheduler_decoder_enforces_the_ranges():
    """A GenerateRequest built without validation cannot cross into the scheduler out of range."""
    bad = GenerateRequest("r", [1, 2], SamplingParams(top_k=2**62))
    with pytest.raises(msgspec.ValidationError, match="top_k"):
        codec.decode(codec.encode(bad))
    good = GenerateRequest("r", [1, 2], SamplingParams(top_k=5, temperature=math.nextafter(2.0, 0)))
    assert codec.decode(codec.encode(good)) == good


def test_relations_against_the_vocabulary():
    p = SamplingParams(stop_token_ids=[5, 700])
    with pytest.raises(InvalidSamplingParams, match=r"\[700\] are outside the vocabulary \[0, 512\)"):
        p.check_relations(vocab_size=512)
    with pytest.raises(InvalidSamplingParams, match="logit_bias"):
        SamplingParams(logit_bias={600: 1.0}).check_relations(vocab_size=512)
