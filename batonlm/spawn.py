"""Starting child processes with the `spawn` method from any kind of main program.

`spawn` re-imports the parent's main module in each child, to unpickle anything defined there.
batonlm's children never need it (their entry points live in batonlm), and importing it is
harmful: a script whose top level creates an `Engine` would create another one in the child
(which then fails), and a main module that is not a file (`python -c`, stdin, a notebook) cannot
be imported at all. So while a child starts, the main module is hidden from `spawn`: the child
starts from batonlm alone, whatever the caller's program is.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import threading

_lock = threading.Lock()  # two threads starting children must not interleave the hide/restore
_HIDDEN = ("__file__", "__spec__")


@contextlib.contextmanager
def _main_module_hidden():
    with _lock:
        main = sys.modules.get("__main__")
        if main is None:
            yield
            return
        saved = {k: main.__dict__[k] for k in _HIDDEN if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def start(process: mp.process.BaseProcess) -> None:
    with _main_module_hidden():
        process.start()


def parent_pid() -> int:
    """In a child, the pid of the process that started it (not `os.getppid()` now: that parent
    may be gone already, the child re-parented, while its interpreter started and imported)."""
    import os

    parent = mp.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


def exit_child(code: int) -> None:
    """End a child process now, after what its normal end runs (multiprocessing's finalizers,
    e.g. shared semaphores; the logs flushed), without the interpreter's teardown: with torch
    loaded that takes about a second, and the server's exit waits for its children."""
    import logging
    import os
    from multiprocessing import util

    util._exit_function()  # type: ignore[attr-defined]  # what Process._bootstrap runs at a child's end
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
