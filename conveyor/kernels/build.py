"""Build a C++ source into a shared library once per (source, compiler, flags, instruction-set level), cache it.

The cache lives in ``$CONVEYOR_CACHE_DIR`` (default ``~/.cache/conveyor/kernels``). Its key hashes the source,
the compiler's identity (path and ``--version``), every flag, the level and the machine, so a cache shared
between machines (an NFS home, a container volume) never hands one CPU a binary built for another: each
level's binary is built with that level's explicit ISA flags, and only a level this CPU reports is loaded.
A failed build raises BuildError carrying the compiler's own message.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")


class BuildError(RuntimeError):
    """The kernel could not be built here; the message says why (the compiler's output when it ran)."""


def cache_dir() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "conveyor", "kernels")
    return os.environ.get("CONVEYOR_CACHE_DIR", default)


def find_compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    raise BuildError("no C++ compiler found (set CXX, or install g++)")


@functools.lru_cache(maxsize=8)
def compiler_identity(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{compiler} --version failed: {e}") from e
    return f"{compiler}\n{out.stdout.strip()}"


def library_path(name: str, source: str, level: str, flags: tuple[str, ...], compiler: str) -> str:
    key = hashlib.sha256("\0".join([source, compiler_identity(compiler), *flags, level,
                                    platform.machine()]).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{name}-{level}-{key}.so")


def build_library(name: str, source: str, level: str, level_flags: tuple[str, ...]) -> str:
    """The path of the built library (building it first when the cache lacks it)."""
    compiler = find_compiler()
    flags = BASE_FLAGS + tuple(level_flags)
    path = library_path(name, source, level, flags, compiler)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        src = os.path.join(tmp, f"{name}.cpp")
        with open(src, "w") as f:
            f.write(source)
        out = os.path.join(tmp, f"{name}.so")
        # No -ffast-math anywhere: linking with it pulls in crtfastmath.o, which flips the whole process into
        # flush-to-zero mode when the library loads (and the kernels rely on IEEE infinities).
        cmd = [compiler, *flags, "-shared", src, "-o", out]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"{' '.join(cmd)}: {e}") from e
        if res.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} exited with {res.returncode}:\n{res.stderr.strip()[-4000:]}")
        os.replace(out, path)  # atomic: a concurrent builder never loads a half-written file
    return path
