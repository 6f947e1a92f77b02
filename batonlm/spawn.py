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
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

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


# How this process starts device workers: `spawn` (a fresh interpreter each, which imports torch
# anew: about a second of CPU) or `forkserver` (forked from a server process that imported the
# worker's modules once, when the first worker started). A scheduler starts its worker once, and
# gains nothing from a server process beside it; a program that builds schedulers in its own
# process again and again (the test suite's harness) saves that second per start.
WORKER_START_METHODS = ("spawn", "forkserver")
_worker_start = "spawn"
# What the fork server imports once: what every worker imports before it loads a model.
_WORKER_PRELOAD = ["batonlm.device.worker_preload"]


def set_worker_start_method(method: str) -> None:
    """Start this process's device workers by `method` from now on (not its children's)."""
    global _worker_start
    if method not in WORKER_START_METHODS:
        raise ValueError(f"the worker start method must be one of {', '.join(WORKER_START_METHODS)}, not {method!r}")
    _worker_start = method


def worker_process(target: Callable[..., None], args: tuple, name: str) -> mp.process.BaseProcess:
    """A device worker process (not started yet). A forked worker gets this process's environment
    and standard output and error as they are when it starts, as a spawned one does (not the fork
    server's, taken when that started)."""
    if _worker_start == "forkserver":
        forkserver = mp.get_context("forkserver")
        forkserver.set_forkserver_preload(_WORKER_PRELOAD)
        return forkserver.Process(target=_as_this_process, args=(_Inherited(), target, args), name=name, daemon=False)
    return mp.get_context("spawn").Process(target=target, args=args, name=name, daemon=False)


class _Inherited:
    """This process's environment and its stdout and stderr, pickled into a forked child: the
    descriptors travel as multiprocessing passes a Connection's."""

    def __reduce__(self):
        from multiprocessing import reduction

        sys.stdout.flush()
        sys.stderr.flush()
        return _InheritedInChild, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2))


class _InheritedInChild:
    def __init__(self, environ: dict[str, str], stdout: Any, stderr: Any) -> None:
        self.environ = environ
        self.fds = (stdout.detach(), stderr.detach())

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for fd, target in zip(self.fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def _as_this_process(inherited: Any, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    inherited.apply()
    target(*args)


def parent_gone() -> bool:
    """In a child, whether the process that started it has exited (a cancelled start: the
    interpreter started and imported meanwhile). Its pipe to the parent says so, whichever process
    forked it (a fork server's children have that server as their OS parent)."""
    parent = mp.parent_process()
    return parent is not None and not parent.is_alive()


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
