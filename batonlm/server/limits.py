"""Request-level limits from the server arguments, checked before anything is tokenized or sent
to the scheduler (a 400 naming the field beyond them). Value ranges are not here: they are
SamplingParams'; these are policy, and `batonlm serve --help` lists their flags."""

from __future__ import annotations

from batonlm.config import ServerArgs
from batonlm.server.errors import bad_request


def _at_most(param: str, count: int, limit: int, what: str) -> None:
    if count > limit:
        raise bad_request(f"at most {limit} {what} are allowed, got {count}", param=param, code="limit_exceeded")


def check_choices(args: ServerArgs, num_prompts: int, n: int, prompt_param: str) -> None:
    _at_most(prompt_param, num_prompts, args.max_prompts_per_request, "prompts per request")
    _at_most("n", n, args.max_n, "choices (n)")


def check_sampling_limits(
    args: ServerArgs,
    *,
    stops: list[str],
    num_stop_token_ids: int,
    num_logit_bias: int,
    logprobs: int | None,
    prefix: str = "",
    logprobs_name: str = "logprobs",
    prompt_logprobs: int | None = None,
) -> None:
    """Stop strings, stop token ids, logit bias entries and top logprobs; parameters are named
    `prefix + field` (e.g. "sampling_params.stop")."""
    _at_most(prefix + "stop", len(stops), args.max_stop_strings, "stop strings")
    for i, s in enumerate(stops):
        if not s:
            raise bad_request("stop strings must not be empty", param=prefix + "stop")
        if len(s) > args.max_stop_string_length:
            raise bad_request(
                f"stop string {i} has {len(s)} characters, at most {args.max_stop_string_length} are allowed",
                param=prefix + "stop", code="limit_exceeded",
            )
    _at_most(prefix + "stop_token_ids", num_stop_token_ids, args.max_stop_token_ids, "stop token ids")
    _at_most(prefix + "logit_bias", num_logit_bias, args.max_logit_bias, "logit_bias entries")
    if logprobs is not None:
        check_top_logprobs(args, prefix + logprobs_name, logprobs)
    if prompt_logprobs is not None:
        check_top_logprobs(args, prefix + "prompt_logprobs", prompt_logprobs)


def check_top_logprobs(args: ServerArgs, param: str, n: int) -> None:
    _at_most(param, n, args.max_logprobs, "top logprobs")
