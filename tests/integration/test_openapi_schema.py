"""The OpenAPI description is complete, and the server keeps to it under schema-driven fuzzing
(schemathesis): no 5xx, every status and content type documented, every body as described."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from batonlm.bench.server_process import ServerProcess

# A short context keeps every generated request quick; the limits shrink what is generated.
FUZZ_ARGS = ("--context-length", "48", "--max-n", "3", "--max-prompts-per-request", "3", "--max-logprobs", "3")
EXAMPLES_PER_OPERATION = 40
CALLS: Counter = Counter()  # (operation, status) -> calls made by the fuzzing test


@pytest.fixture(scope="module")
def fuzz_server():
    s = ServerProcess(*FUZZ_ARGS)
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    schema.config.update(base_url=fuzz_server.base_url, request_timeout=60)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    schema.config.phases.update(phases=["examples", "fuzzing"])
    schema.config.seed = 20261201  # the same examples every run
    return schema


def test_every_route_is_described(fuzz_server):
    doc = httpx.get(fuzz_server.base_url + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/messages", "/v1/responses"):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in schemas
        assert {"200", "400", "401", "408", "413", "429", "503"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    # Anthropic's routes answer errors in its shape.
    error = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error["$ref"].endswith("/AnthropicErrorResponse")
    assert schemas["MessagesRequest"]["properties"]["stop_sequences"]["anyOf"][0]["maxItems"] == 16
    # This server's limits are in the schema; the ranges are SamplingParams'.
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == 3 and chat["top_logprobs"]["anyOf"][0]["maximum"] == 3
    assert chat["temperature"]["maximum"] == 2.0
    native = schemas["NativeSamplingParams"]["properties"]
    assert native["top_k"]["maximum"] == 2**31 - 1 and "stop" in native
    embeddings = doc["paths"]["/v1/embeddings"]["post"]["responses"]
    assert set(embeddings["200"]["content"]) == {"application/json"} and "400" in embeddings


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_the_server_keeps_to_its_schema(case, fuzz_server):
    response = case.call(base_url=fuzz_server.base_url, timeout=60)
    CALLS[(case.operation.label, response.status_code // 100)] += 1
    case.validate_response(
        response,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
    )


def test_the_fuzzing_exercised_every_operation():
    """Runs after the fuzzing: it really sent requests, valid and invalid ones, to every route
    (valid ones are rarer: many constraints between fields are beyond a schema)."""
    for op in ("POST /v1/chat/completions", "POST /v1/completions", "POST /generate", "POST /v1/messages",
               "POST /v1/responses", "POST /v1/messages/count_tokens", "POST /v1/responses/input_tokens",
               "POST /v1/embeddings"):
        assert CALLS[(op, 2)] >= 1 and CALLS[(op, 4)] >= 10, str(sorted(CALLS.items()))
    for op in ("GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}"):
        assert CALLS[(op, 4)] >= 1, str(sorted(CALLS.items()))
    for op in ("GET /health", "GET /v1/models", "GET /metrics"):
        assert CALLS[(op, 2)] >= 1, dict(CALLS)
    assert not any(status == 5 for _, status in CALLS), dict(CALLS)
