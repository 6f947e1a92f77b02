"""Private ZMQ endpoints: `ipc://` paths in a temporary directory unique to one server."""

from __future__ import annotations

import tempfile


def new_endpoints() -> tuple[str, str, str]:
    """(ipc dir, request endpoint, output endpoint): two servers on one machine never collide."""
    d = tempfile.mkdtemp(prefix="batonlm-ipc-")
    return d, f"ipc://{d}/requests", f"ipc://{d}/outputs"
