"""Where compiled code comes from on the CPU: the C++ compiler (the one inductor would use), the
per-user cache that inductor's graphs and batonlm's own kernels are built into, and the build of
a kernel's shared library (`cpu_attention.cpp`, `cpu_linear.cpp`): ops registered with torch's
dispatcher, built against the headers of the torch that loads them."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20"]


def _torch_flags() -> list[str]:
    """Compile against this torch's headers (its C++ ABI) and link its libraries."""
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return [f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]


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


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_library(source: Path) -> Path:
    """`source`'s shared library (-O3 -march=native, OpenMP and the rest of torch's runtime linked),
    compiled into the cache the first time on this machine and kept by source, compiler, torch
    version and CPU flags. RuntimeError (or OSError) when it cannot be built."""
    cxx = cxx_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++; or $CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    flags = [*FLAGS, *_torch_flags()]
    key = hashlib.sha256("\n".join([source.read_text(), cxx, version, torch.__version__, *flags, _cpu_flags()]).encode())
    out_dir = cache_root() / "kernels"
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cxx, str(source), "-o", tmp, *flags], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # whole or not at all: another process may be building it too
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_ops(source: Path, instead: str) -> bool:
    """Load the ops `source` registers under torch.ops.batonlm (built the first time); False,
    with one warning saying what runs `instead`, where it cannot be built or loaded."""
    try:
        torch.ops.load_library(str(build_library(source)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("the CPU kernel %s could not be built (%s): %s", source.name, e, instead)
        return False
    return True
