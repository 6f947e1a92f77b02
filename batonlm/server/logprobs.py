"""Logprobs in the answers' shapes: chat completions (`content` entries), text completions
(OpenAI's legacy `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, prompt tokens
first with `echo`), and /generate's SGLang lists ([logprob, id, text])."""

from __future__ import annotations

from batonlm.sampling_params import SamplingParams
from batonlm.server.state import ServerState
from batonlm.tokenizer_manager.request_state import GenerationChunk, TokenLogprob


def prompt_token_logprobs(ids: list[int], params: SamplingParams, chunk: GenerationChunk) -> list[TokenLogprob]:
    """The prompt tokens from logprob_start_len on with the logprobs a first chunk carries."""
    assert chunk.prompt_logprobs is not None and chunk.prompt_top_logprobs is not None
    tokens = ids[params.logprob_start_len :]
    return [
        TokenLogprob(t, lp, None if lp is None else list(top))
        for t, lp, top in zip(tokens, chunk.prompt_logprobs, chunk.prompt_top_logprobs, strict=True)
    ]


def chat_logprobs(state: ServerState, items: list[TokenLogprob]) -> dict:
    tb = state.token_bytes

    def entry(token_id: int, logprob: float | None) -> dict:
        return {"token": tb.text(token_id), "logprob": logprob, "bytes": list(tb.bytes(token_id))}

    return {
        "content": [{**entry(it.token_id, it.logprob), "top_logprobs": [entry(t, lp) for t, lp in it.top or []]}
                    for it in items],
        "refusal": None,
    }


def completion_logprobs(state: ServerState, items: list[TokenLogprob], text_offset: int,
                        prompt_offsets: list[int] | None = None) -> dict:
    """OpenAI's legacy shape. `top_logprobs` holds the alternatives and the token itself ("up to
    logprobs + 1" entries, as OpenAI and vLLM give); two tokens with the same text (a byte
    piece and a normal one) share one key, which keeps the higher logprob. The first items may
    be echoed prompt tokens with their offsets in the echo (`prompt_offsets`); the others'
    offsets run on from `text_offset`."""
    tb = state.token_bytes
    given = prompt_offsets or []
    tokens, offsets = [], []
    for i, it in enumerate(items):
        tokens.append(tb.text(it.token_id))
        if i < len(given):
            offsets.append(given[i])
            continue
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [it.logprob for it in items],
        "top_logprobs": [_top_by_text(tb, it) for it in items],
        "text_offset": offsets,
    }


def echo(tokenizer, prompt_ids: list[int], keep_special: bool) -> tuple[str, list[int]]:
    """A prompt as its echo, and each of its tokens' offset in that text: decoded as one text,
    so the offsets index into it. A token-id prompt keeps its special tokens (they are what the
    client sent; vLLM echoes them too); a text prompt drops those the tokenizer added."""
    from batonlm.tokenizer_manager.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=not keep_special)
    offsets = []
    for token in prompt_ids:
        offsets.append(len(detok.text))
        detok.add([token])
    detok.flush()
    return detok.text, offsets


def _top_by_text(tb, it: TokenLogprob) -> dict[str, float] | None:
    if it.top is None or it.logprob is None:
        return None
    out: dict[str, float] = {}
    for token_id, logprob in (*it.top, (it.token_id, it.logprob)):
        text = tb.text(token_id)
        if text not in out or logprob > out[text]:
            out[text] = logprob
    return out


def generate_logprobs(state: ServerState, items: list[TokenLogprob], with_text: bool) -> tuple[list, list]:
    """SGLang's (token logprobs, top logprobs): [logprob, id, text or None] per token, and per
    token its alternatives in the same shape (None where a token has none)."""

    def entry(lp: float | None, token_id: int) -> list:
        return [lp, token_id, state.token_bytes.text(token_id) if with_text else None]

    return (
        [entry(it.logprob, it.token_id) for it in items],
        [None if it.top is None else [entry(lp, t) for t, lp in it.top] for it in items],
    )
