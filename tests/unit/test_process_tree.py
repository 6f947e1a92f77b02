"""The process tree and its resident memory (/proc): what the ready line states."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from batonlm.process_tree import descendants, rss_bytes, tree_rss

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_child_holding_memory_is_counted_in_the_tree():
    # This process's RSS read on both sides of the tree's (another thread may allocate between).
    before = rss_bytes(os.getpid())
    own = tree_rss()
    after_own = rss_bytes(os.getpid())
    assert before is not None and after_own is not None
    assert own is not None and own[0] >= min(before, after_own) > 0
    # A child that touches 64 MiB: the tree holds at least that much more, in one more process.
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(64 << 20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        for _ in range(200):  # until the child has touched its buffer
            size = rss_bytes(child.pid)
            if size is not None and size > 64 << 20:
                break
            time.sleep(0.05)
        assert child.pid in descendants(os.getpid())
        after = tree_rss()
        assert after is not None and after[1] >= 2
        assert after[0] >= rss_bytes(child.pid) > 64 << 20
    finally:
        child.communicate(b"")
    assert rss_bytes(child.pid) is None  # gone: unknown, not zero
