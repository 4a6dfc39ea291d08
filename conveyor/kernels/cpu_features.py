"""What this CPU can run, read at run time: the instruction-set level the native kernels are built for, and
whether bfloat16 arithmetic is native (which decides ``dtype="auto"``).

Levels, lowest first: "none" (no native kernels: the torch paths), "avx2" (AVX2 + FMA: every x86-64 machine
this project runs on), "avx512" (AVX-512 F/BW/VL/DQ), "avx512bf16" (also AVX512_BF16 and AVX512_VNNI). ``CONVEYOR_CPU_ISA``
forces a level, but never one above what the CPU reports (a binary the CPU cannot run would die of SIGILL).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

LEVELS = ("none", "avx2", "avx512", "avx512bf16")

# The compiler flags of each level: explicit ISA flags, never -march=native, so a binary in a shared cache
# runs on every CPU that reports its level.
LEVEL_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-DCVK_AVX2"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCVK_AVX512"),
    "avx512bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
                   "-mf16c", "-DCVK_AVX512BF16", "-DCVK_VNNI"),
}
_REQUIRED = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    # every CPU with AVX512_BF16 so far (Cooper Lake, Sapphire Rapids, Zen 4/5) also has AVX512_VNNI, which the
    # quantized GEMM's dot products use at this level
    "avx512bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"},
}


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    machine: str

    @property
    def native_level(self) -> str:
        """The highest level whose instructions this CPU reports."""
        if self.machine not in ("x86_64", "amd64", "AMD64"):
            return "none"
        for level in reversed(LEVELS[1:]):
            if _REQUIRED[level] <= self.flags:
                return level
        return "none"

    @property
    def native_bf16(self) -> bool:
        """bfloat16 matmuls run in hardware (AVX512_BF16 or AMX-BF16), fast enough to be the default dtype."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def has_amx(self) -> bool:
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def has_amx_int8(self) -> bool:
        """AMX's int8 tile products (TDPBSUD), which the quantized GEMM uses beside the bfloat16 ones."""
        return self.has_amx and "amx_int8" in self.flags


def _flags_from_proc() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def _flags_from_torch() -> frozenset[str]:
    """Where /proc/cpuinfo is missing: torch's own CPU probes (cpuinfo library)."""
    import torch

    flags = set()
    probes = {"_is_avx2_supported": ("avx2", "fma", "f16c"),
              "_is_avx512_supported": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
              "_is_avx512_bf16_supported": ("avx512_bf16",), "_is_amx_tile_supported": ("amx_tile", "amx_bf16")}
    for probe, names in probes.items():
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            flags.update(names)
    return frozenset(flags)


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    flags = _flags_from_proc()
    return CpuFeatures(flags if flags is not None else _flags_from_torch(), platform.machine())


def kernel_level() -> str:
    """The level to build and load the kernels at: the CPU's own, or lower when CONVEYOR_CPU_ISA asks."""
    native = cpu_features().native_level
    forced = os.environ.get("CONVEYOR_CPU_ISA", "").strip().lower()
    if not forced:
        return native
    if forced not in LEVELS:
        raise ValueError(f"CONVEYOR_CPU_ISA must be one of {', '.join(LEVELS)}, got {forced!r}")
    return forced if LEVELS.index(forced) <= LEVELS.index(native) else native
