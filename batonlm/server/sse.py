"""Server-sent events framing."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    # orjson: several times faster than json.dumps, and every streamed token pays for one event.
    return b"data: " + orjson.dumps(payload) + b"\n\n"
