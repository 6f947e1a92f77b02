"""A process and its descendants on Linux (/proc): who they are, and the memory they hold
(the ready line's RSS; the tests' and benchmarks' leftover checks). Elsewhere: none, unknown."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def rss_bytes(pid: int) -> int | None:
    """The resident set of `pid` (None when it is gone or /proc has no status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def tree_rss(pid: int | None = None) -> tuple[int, int] | None:
    """(bytes, processes): the resident sets of `pid` (default: this process) and its
    descendants added up — pages shared between them (torch's libraries) counted in each, as
    `ps` and `top` count them. None where /proc cannot tell."""
    pid = os.getpid() if pid is None else pid
    own = rss_bytes(pid)
    if own is None:
        return None
    known = [own, *(s for p in descendants(pid) if (s := rss_bytes(p)) is not None)]
    return sum(known), len(known)
