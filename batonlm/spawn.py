"""Starting child processes with the `spawn` method from any kind of main program.

`spawn` re-imports the parent's main module in the child. When that module is not a real file
(`python - < script`, `python -c`, some notebooks and embedding hosts) the child would fail to
start; it does not need the parent's main module, so it is hidden from the child.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys


@contextlib.contextmanager
def _main_module_importable():
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def start(process: mp.process.BaseProcess) -> None:
    with _main_module_importable():
        process.start()
