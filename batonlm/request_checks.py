"""Whether a request can ever be served, with the numbers when not. The frontend checks before
sending (for a clear 400); the scheduler checks again on arrival, because it guards the device:
an id outside the vocabulary or a prompt beyond the context would fail a forward pass."""

from __future__ import annotations

from batonlm.sampling_params import InvalidSamplingParams, SamplingParams


class RequestRejected(ValueError):
    """The request cannot be served as given (the message gives the numbers); `param` names the
    request field it is about, where the caller said."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def kv_slots_needed(prompt_len: int, max_new_tokens: int, context_length: int) -> tuple[int, int]:
    """(KV slots the request holds at its longest, its max new tokens capped by the context)."""
    max_new = min(max_new_tokens, context_length - prompt_len)
    return prompt_len + max_new - 1, max_new


def check_request(
    input_ids: list[int],
    params: SamplingParams,
    *,
    context_length: int,
    vocab_size: int,
    kv_capacity: int,
    prompt_param: str | None = None,
) -> None:
    """Raise RequestRejected (naming `prompt_param`) or InvalidSamplingParams."""
    n = len(input_ids)
    if n == 0:
        raise RequestRejected("the prompt is empty", prompt_param)
    if n >= context_length:
        raise RequestRejected(
            f"the prompt has {n} tokens but the context length is {context_length} "
            f"(at most {context_length - 1} prompt tokens leave room for one new token)",
            prompt_param,
        )
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", prompt_param)
    params.check_relations(vocab_size)
    if params.prompt_logprobs is not None and params.logprob_start_len > n:
        raise InvalidSamplingParams(
            "logprob_start_len", f"must be at most the prompt's length ({n} tokens), got {params.logprob_start_len}"
        )
    needed, max_new = kv_slots_needed(n, params.max_new_tokens, context_length)
    if needed > kv_capacity:
        raise RequestRejected(
            f"the request needs {needed} KV slots ({n} prompt + {max_new} new tokens - 1) "
            f"but the KV cache holds {kv_capacity}",
            prompt_param,
        )
