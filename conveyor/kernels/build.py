"""Build a directory of C++ sources into one shared library per (sources, compiler, flags, instruction-set level),
cache it.

The cache lives in ``$CONVEYOR_CACHE_DIR`` (default ``~/.cache/conveyor/kernels``). Its key hashes every source
and header of the directory, the compiler's identity (path and ``--version``), every flag, the level and the
machine, so a cache shared between machines (an NFS home, a container volume) never hands one CPU a binary built for another: each
level's binary is built with that level's explicit ISA flags, and only a level this CPU reports is loaded.
A failed build raises BuildError carrying the compiler's own message.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

SOURCE_SUFFIXES = (".cpp", ".h")
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


def read_sources(src_dir: str) -> dict[str, str]:
    """Every source and header of ``src_dir`` (file name -> text): all of them go into the cache key, so an edit
    to any header rebuilds."""
    return {name: open(os.path.join(src_dir, name)).read() for name in sorted(os.listdir(src_dir))
            if name.endswith(SOURCE_SUFFIXES)}


def sources_digest_text(sources: dict[str, str]) -> str:
    return "\0".join(f"{name}\0{text}" for name, text in sorted(sources.items()))


def library_path(name: str, source: str, level: str, flags: tuple[str, ...], compiler: str) -> str:
    """``source``: the text the key covers (``sources_digest_text`` of the whole source directory)."""
    key = hashlib.sha256("\0".join([source, compiler_identity(compiler), *flags, level,
                                    platform.machine()]).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{name}-{level}-{key}.so")


def _run(cmd: list[str]) -> None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{' '.join(cmd)}: {e}") from e
    if res.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} exited with {res.returncode}:\n{res.stderr.strip()[-4000:]}")


def build_library(name: str, src_dir: str, level: str, level_flags: tuple[str, ...]) -> str:
    """The path of the library built from every ``.cpp`` of ``src_dir`` (building it first when the cache lacks
    it): one shared object per level, its translation units compiled in parallel."""
    compiler = find_compiler()
    flags = BASE_FLAGS + tuple(level_flags)
    sources = read_sources(src_dir)
    path = library_path(name, sources_digest_text(sources), level, flags, compiler)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        for fname, text in sources.items():  # the snapshot that was hashed, not whatever the directory holds now
            with open(os.path.join(tmp, fname), "w") as f:
                f.write(text)
        units = [f for f in sources if f.endswith(".cpp")]
        if not units:
            raise BuildError(f"no .cpp sources in {src_dir}")
        objs = [os.path.join(tmp, f[:-len(".cpp")] + ".o") for f in units]
        # No -ffast-math anywhere: linking with it pulls in crtfastmath.o, which flips the whole process into
        # flush-to-zero mode when the library loads (and the kernels rely on IEEE infinities).
        cmds = [[compiler, *flags, "-c", os.path.join(tmp, f), "-o", o] for f, o in zip(units, objs)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as pool:
            for fut in [pool.submit(_run, c) for c in cmds]:
                fut.result()  # the first failure's BuildError, with its compiler message
        out = os.path.join(tmp, f"{name}.so")
        _run([compiler, *flags, "-shared", *objs, "-o", out])
        os.replace(out, path)  # atomic: a concurrent builder never loads a half-written file
    return path
