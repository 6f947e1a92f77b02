"""Where compiled code comes from on the CPU: the C++ compiler (the one inductor would use) and
the per-user cache that inductor's graphs and batonlm's own kernels are built into."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU, if there is one."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def cache_root() -> Path:
    """$XDG_CACHE_HOME/batonlm (~/.cache/batonlm): compiled graphs and kernels, kept across runs."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "batonlm"
