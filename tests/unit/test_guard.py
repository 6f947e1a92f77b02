"""The guard middleware: a request id on every answer, the API key and size checks, and a bug
answered with a bare 500 (no exception type, message or path) and logged once."""

import logging

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from batonlm.server.guard import GuardMiddleware


def _app() -> Starlette:
    async def ok(request):
        return JSONResponse({"ok": True})

    async def bug(request):
        raise ValueError("secret detail in /home/user/model.py")

    # As in the server: the guard inside Starlette's own outermost error middleware.
    return Starlette(
        routes=[Route("/v1/ok", ok, methods=["GET", "POST"]), Route("/v1/bug", bug)],
        middleware=[Middleware(GuardMiddleware, api_key="k", max_request_bytes=100)],
    )


def test_a_bug_is_a_bare_500_with_the_request_id_and_one_log_record(caplog):
    client = TestClient(_app(), raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR):
        r = client.get("/v1/bug", headers={"Authorization": "Bearer k", "X-Request-Id": "client-42"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err == {"message": "internal error", "type": "internal_error", "param": None, "code": "internal_error",
                   "request_id": "client-42"}
    assert r.headers["x-request-id"] == "client-42"
    records = [rec for rec in caplog.records if rec.exc_info]
    assert len(records) == 1 and "client-42" in records[0].getMessage()
    assert "secret detail" in str(records[0].exc_info[1])  # the details are in the log only


def test_request_ids_key_and_size():
    client = TestClient(_app())
    ok = client.get("/v1/ok", headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200 and ok.headers["x-request-id"].startswith("req_")
    # A client's id that is too long or not plain is replaced.
    weird = client.get("/v1/ok", headers={"Authorization": "Bearer k", "X-Request-Id": "a b" * 40})
    assert weird.headers["x-request-id"].startswith("req_")
    denied = client.get("/v1/ok")
    assert denied.status_code == 401 and denied.json()["error"]["request_id"] == denied.headers["x-request-id"]
    big = client.post("/v1/ok", content=b"x" * 101, headers={"Authorization": "Bearer k"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
