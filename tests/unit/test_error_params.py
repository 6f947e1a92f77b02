"""Errors name the field as the user's own request names it: a dialect read as a chat request
(Responses, Messages) renames the chat fields, for the frontend's checks (`renamed_params`) and
for the scheduler's refusals of a constraint (`rename_param`, `Job.rejected`)."""

import pytest

from batonlm.ipc.messages import ABOUT_CONSTRAINT, TokenOutput, merge_outputs
from batonlm.request_checks import RequestRejected
from batonlm.server.errors import bad_request, rename_param, renamed_params
from batonlm.server.pipeline import Job

RESPONSES = ((r"^tools\.(\d+)\.function\.parameters", r"tools.\1.parameters"),
             (r"^response_format(\.json_schema)?", "text.format"), (r"^max_tokens$", "max_output_tokens"))


def test_a_chat_field_is_renamed_by_the_first_rule_that_applies():
    assert rename_param("response_format.json_schema.schema", RESPONSES) == "text.format.schema"
    assert rename_param("tools.3.function.parameters", RESPONSES) == "tools.3.parameters"
    assert rename_param("max_tokens", RESPONSES) == "max_output_tokens"
    assert rename_param("max_tokens_x", RESPONSES) == "max_tokens_x"  # whole names only where anchored so
    with pytest.raises(Exception) as e, renamed_params(RESPONSES):
        raise bad_request("max_tokens must be at least 1", param="max_tokens")
    assert (e.value.param, e.value.message) == ("max_output_tokens", "max_output_tokens must be at least 1")


def test_a_schedulers_refusal_names_the_constraint_field_only_when_it_is_about_the_constraint():
    job = Job(req=None, rid="r", created=0, constraint={"ebnf": "root ::= x"}, constraint_param="ebnf")
    about = job.rejected("its grammar has a dead end", ABOUT_CONSTRAINT)
    assert isinstance(about, RequestRejected) and about.param == "ebnf"
    assert job.rejected("its LoRA adapter was unloaded", None).param is None


def test_what_an_error_is_about_survives_merging_outputs():
    a = TokenOutput("r", [5])
    b = TokenOutput("r", [], "abort", "a dead end", error_about=ABOUT_CONSTRAINT)
    merged = merge_outputs([a, b])
    assert (merged.token_ids, merged.finish_reason, merged.error, merged.error_about) == (
        [5], "abort", "a dead end", ABOUT_CONSTRAINT)
