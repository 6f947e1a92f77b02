"""The server's OpenAPI description: every route with its request body, its answers and its
errors, and this server's limits (n, stop strings, ...) as schema bounds, so that schema-driven
clients and fuzzers (schemathesis) can use it.

The handlers read their bodies themselves (for the size limit, the read deadline and clean JSON
errors), so FastAPI cannot see them: the bodies are declared here from the same models.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from batonlm.config import ServerArgs
from batonlm.sampling_params import SamplingParams
from batonlm.server import anthropic_protocol, protocol, responses, responses_protocol
from batonlm.server.errors import dialect_of
from batonlm.server.limits import apply_limits

REF = "#/components/schemas/{model}"

# (path, request model, answer model, streams?)
POST_ROUTES: tuple[tuple[str, type[BaseModel], type[BaseModel], bool], ...] = (
    ("/v1/chat/completions", protocol.ChatCompletionRequest, responses.ChatCompletion, True),
    ("/v1/completions", protocol.CompletionRequest, responses.Completion, True),
    ("/generate", protocol.NativeGenerateRequest, responses.GenerateResponse, True),
    ("/tokenize", protocol.TokenizeRequest, responses.TokenizeResponse, False),
    ("/detokenize", protocol.DetokenizeRequest, responses.DetokenizeResponse, False),
    ("/v1/messages", anthropic_protocol.MessagesRequest, responses.AnthropicMessage, True),
    ("/v1/messages/count_tokens", anthropic_protocol.CountTokensRequest, responses.MessageTokenCount, False),
    ("/v1/responses", responses_protocol.ResponsesRequest, responses.ResponseObject, True),
    ("/v1/responses/input_tokens", responses_protocol.InputTokensRequest, responses.InputTokenCount, False),
    ("/v1/embeddings", protocol.EmbeddingRequest, responses.EmbeddingList, False),
)
# The stored responses of the Responses API: (method, path) -> the answer.
RESPONSE_ROUTES: dict[tuple[str, str], type[BaseModel]] = {
    ("get", "/v1/responses/{response_id}"): responses.ResponseObject,
    ("get", "/v1/responses/{response_id}/input_items"): responses.InputItemList,
    ("delete", "/v1/responses/{response_id}"): responses.DeletedResponse,
    ("post", "/v1/responses/{response_id}/cancel"): responses.ResponseObject,
}
# How a route's stream ends.
STREAM_ENDS = {"/v1/messages": "Anthropic's named events, ending in message_stop",
               "/v1/responses": "typed events with sequence numbers, ending in response.completed or response.incomplete"}
FLUSH = "/flush_cache"
GET_ROUTES: dict[str, type[BaseModel]] = {
    "/health": responses.Health,
    "/v1/models": responses.ModelList,
    "/v1/models/{model}": responses.ModelCard,
    "/version": responses.Version,
    "/tokenizer_info": responses.TokenizerInfo,
}
EXAMPLES = {
    "/v1/chat/completions": lambda model: {
        "model": model, "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 16,
    },
    "/v1/completions": lambda model: {"model": model, "prompt": "Once upon a time", "max_tokens": 16},
    "/generate": lambda model: {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 16}},
    "/tokenize": lambda model: {"model": model, "prompt": "Once upon a time"},
    "/detokenize": lambda model: {"model": model, "tokens": [1, 403, 407, 261]},
    "/v1/messages": lambda model: {"model": model, "max_tokens": 16,
                                   "messages": [{"role": "user", "content": "Once upon a time"}]},
    "/v1/messages/count_tokens": lambda model: {"model": model,
                                                "messages": [{"role": "user", "content": "Once upon a time"}]},
    "/v1/responses": lambda model: {"model": model, "input": "Once upon a time", "max_output_tokens": 16},
    "/v1/responses/input_tokens": lambda model: {"model": model, "input": "Once upon a time"},
    "/v1/embeddings": lambda model: {"model": model, "input": ["Once upon a time", "The end"]},
}
ERRORS = {
    "400": "A field is invalid or beyond a limit (`param` names it)",
    "401": "The API key is missing or wrong",
    "404": "The model does not exist",
    "408": "The request body arrived too slowly, or the request ran past --request-timeout",
    "413": "The body is larger than --max-request-bytes",
    "429": "Too many requests are waiting (--max-queued-requests); see Retry-After",
    "500": "A bug (the server log has the details)",
    "503": "The scheduler is not running, the server is shutting down, or it has too many connections",
}


def _json(schema_ref: str) -> dict:
    return {"application/json": {"schema": {"$ref": schema_ref}}}


def _errors(codes: list[str], path: str = "") -> dict:
    """The error answers of a route, in its dialect's shape."""
    model = "AnthropicErrorResponse" if dialect_of(path) == "anthropic" else "ErrorResponse"
    return {c: {"description": ERRORS[c], "content": _json(REF.format(model=model))} for c in codes}


def _native_sampling_params(args: ServerArgs) -> tuple[dict, dict]:
    """The schema of /generate's sampling_params: SamplingParams' fields and ranges (msgspec's
    own schema of it) plus SGLang's `stop`."""
    (ref,), components = msgspec.json.schema_components([SamplingParams], ref_template=REF.replace("{model}", "{name}"))
    name = ref["$ref"].rsplit("/", 1)[1]
    native = copy.deepcopy(components[name])
    native["title"] = "NativeSamplingParams"
    native["properties"]["stop"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
    native["properties"]["n"] = {"type": "integer", "minimum": 1, "default": 1}
    apply_limits(native["properties"], args)
    return {"$ref": REF.format(model="NativeSamplingParams")}, {"NativeSamplingParams": native}


def _set_on_numbers(schema: dict, **bounds: int) -> None:
    for v in [schema, *schema.get("anyOf", [])]:
        if v.get("type") in ("integer", "number"):
            v.update(bounds)


def build_openapi(app: FastAPI, args: ServerArgs, context_length: int) -> dict:
    """`context_length` bounds max_tokens (a prompt needs a token too)."""
    schema = get_openapi(
        title="batonlm",
        version=app.version,
        description="An OpenAI-compatible LLM server (chat and text completions, SSE streaming) with "
        "SGLang's native /generate. Errors follow OpenAI's shape and carry the request id.",
        routes=app.routes,
    )
    from batonlm.server.lora_adapters import LoadLoRAAdapter, UnloadLoRAAdapter

    lora_routes: dict[str, type[BaseModel]] = {"/v1/load_lora_adapter": LoadLoRAAdapter,
                                               "/v1/unload_lora_adapter": UnloadLoRAAdapter}
    answers: list[type[BaseModel]] = [*(r for _, _, r, _ in POST_ROUTES), *GET_ROUTES.values(),
                                      *RESPONSE_ROUTES.values(), responses.ErrorResponse,
                                      responses.AnthropicErrorResponse]
    bodies: list[type[BaseModel]] = [*(m for _, m, _, _ in POST_ROUTES), *lora_routes.values()]
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in bodies] + [
        (m, "serialization") for m in answers
    ]
    _, defs = models_json_schema(models, ref_template=REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs.get("$defs", {}))
    sp_ref, sp_components = _native_sampling_params(args)
    components.update(sp_components)
    components["NativeGenerateRequest"]["properties"]["sampling_params"] = {"anyOf": [sp_ref, {"type": "null"}]}

    served = [args.model_name, *(name for name, _ in args.lora_adapters)]  # the model and its adapters at start
    native_props = components["NativeSamplingParams"]["properties"]
    for field in ("max_new_tokens", "min_new_tokens"):
        _set_on_numbers(native_props[field], maximum=context_length - 1)
    apply_limits(components["NativeGenerateRequest"]["properties"], args)
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = components[name]["properties"]
        # Only the served model exists (another name is a 404).
        props["model"] = {"anyOf": [{"type": "string", "enum": served}, {"type": "null"}], "default": None}
        for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
            _set_on_numbers(props[field], maximum=context_length - 1)
        apply_limits(props, args)
    for name in ("TokenizeRequest", "DetokenizeRequest", "CountTokensRequest", "InputTokensRequest"):
        components[name]["properties"]["model"] = {
            "anyOf": [{"type": "string", "enum": [args.model_name]}, {"type": "null"}], "default": None}
    for name, max_field in (("MessagesRequest", "max_tokens"), ("ResponsesRequest", "max_output_tokens")):
        props = components[name]["properties"]
        props["model"] = {"anyOf": [{"type": "string", "enum": served}, {"type": "null"}], "default": None}
        _set_on_numbers(props[max_field], maximum=context_length - 1)
        apply_limits(props, args)

    paths = schema["paths"]
    for path, request_model, answer, streams in POST_ROUTES:
        ends = STREAM_ENDS.get(path, "ending in `data: [DONE]`")
        ok: dict[str, Any] = {"description": f"The answer; with `stream: true`, server-sent events {ends}"
                              if streams else "The answer",
                              "content": {**_json(REF.format(model=answer.__name__)), **({"text/event-stream": {}} if streams else {})}}
        if path == "/generate":  # several prompts or choices: a list of answers
            one = {"$ref": REF.format(model=answer.__name__)}
            ok["content"]["application/json"] = {"schema": {"anyOf": [one, {"type": "array", "items": one}]}}
        body = _json(REF.format(model=request_model.__name__))
        body["application/json"]["example"] = EXAMPLES[path](args.model_name)
        paths[path]["post"].update(
            requestBody={"required": True, "content": body},
            responses={"200": ok, **_errors(["400", "401", "404", "408", "413", "429", "500", "503"], path)},
        )
    for (method, path), answer in RESPONSE_ROUTES.items():
        op = paths[path][method]
        op["responses"].pop("422", None)
        op["responses"]["200"] = {"description": "OK", "content": _json(REF.format(model=answer.__name__))}
        op["responses"].update(_errors(["401", "404", "500"] + (["400"] if path.endswith("/cancel") else [])))
    for path, answer in GET_ROUTES.items():
        op = paths[path]["get"]
        op["responses"].pop("422", None)  # FastAPI's, for a path parameter that is any string
        op["responses"]["200"] = {"description": "OK", "content": _json(REF.format(model=answer.__name__))}
        op["responses"].update(_errors(["401", "500", "503"] + (["404"] if "{model}" in path else [])))
    paths["/health"]["get"]["responses"]["503"] = {
        "description": "The scheduler is not running, or the server is shutting down",
        "content": _json(REF.format(model="Health")),
    }
    paths[FLUSH]["post"]["responses"] = {
        "200": {"description": "The cache is empty", "content": _json(REF.format(model="Health"))},
        **_errors(["400", "401", "500", "503"]),
    }
    paths[FLUSH]["post"]["responses"]["400"]["description"] = "Requests are running or waiting"
    for path, model in lora_routes.items():  # docs/lora.md
        op = paths[path]["post"]
        op["requestBody"] = {"required": True, "content": _json(REF.format(model=model.__name__))}
        op["responses"] = {"200": {"description": "Done", "content": {"text/plain": {"schema": {"type": "string"}}}},
                           **_errors(["400", "401", "404", "413", "500", "503"])}
    metrics = paths["/metrics"]["get"]
    metrics["responses"] = {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
    }
    return schema
