"""The ``kernels`` fixture: the native kernels at every instruction-set level this CPU can run, each built (or
taken from the cache) by the tests themselves; a level above this CPU's is never loaded (it would die of
SIGILL), so a lower CPU runs fewer levels."""

from __future__ import annotations

import pytest

from conveyor.kernels.cpu_features import LEVELS, cpu_features
from conveyor.kernels.cpu_ops import load_cpu_kernels

RUNNABLE = [lvl for lvl in LEVELS[1:] if LEVELS.index(lvl) <= LEVELS.index(cpu_features().native_level)]


@pytest.fixture(scope="module", params=RUNNABLE or [pytest.param("none", marks=pytest.mark.skip("no AVX2"))])
def kernels(request):
    k = load_cpu_kernels(request.param)
    if k is None:
        pytest.skip(f"kernels for {request.param} could not be built here (see the warning)")
    return k
