"""POST /tokenize and /detokenize (vLLM's shapes), GET /tokenizer_info, GET /version: scripting helpers that run
in the frontend alone (the tokenizer and chat template the completions use; no scheduler)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from batonlm.server import openai_common as common
from batonlm.server.errors import bad_request
from batonlm.server.pipeline import json_answer
from batonlm.server.protocol import DetokenizeRequest, TokenizeRequest
from batonlm.server.state import server_state
from batonlm.version import __version__

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    state = server_state(request)
    req = await state.read(request, TokenizeRequest)
    state.check_model(req.model)
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = await common.render_chat(state, messages, req.add_generation_prompt)
    else:
        ids = await state.manager.tokenize_async(req.prompt or "", req.add_special_tokens)
    info = state.manager.info

    def answer() -> dict:
        out = {"count": len(ids), "max_model_len": info.context_length if info else None, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return out

    return await json_answer(len(ids), answer)  # a 4 MiB prompt's token strings: seconds of work


@router.post("/detokenize")
async def detokenize(request: Request):
    state = server_state(request)
    req = await state.read(request, DetokenizeRequest)
    state.check_model(req.model)
    size = len(state.tokenizer)
    bad = next((i for i, t in enumerate(req.tokens) if t >= size), None)
    if bad is not None:
        raise bad_request(f"token id {req.tokens[bad]} at index {bad} is not in the vocabulary (size {size})",
                          param="tokens")
    return {"prompt": await state.manager.detokenize_async(req.tokens)}


@router.get("/version")
async def version():
    return {"version": __version__}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """The tokenizer's special tokens, chat template and class (vLLM's endpoint; lm-eval's
    remote tokenizer reads it)."""
    state = server_state(request)
    tok = state.tokenizer
    info = state.manager.info
    template = getattr(tok, "chat_template", None)
    return {
        "tokenizer_class": type(tok).__name__,
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "chat_template": template if isinstance(template, str) else None,
        "model_max_length": info.context_length if info else None,
    }
