"""Small statistics for distribution tests (scipy is not a dependency)."""

from __future__ import annotations

from collections import Counter


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile with ``df`` degrees of freedom at the normal quantile ``z`` (3.719: p = 1e-4),
    by Wilson and Hilferty's approximation (within 1% for df >= 3; scipy is not a dependency)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * h ** 0.5) ** 3


def two_sample_chi2(a: list, b: list, min_count: int = 10) -> tuple[float, int]:
    """Pearson's two-sample chi-square statistic of two equal-size samples, and its degrees of freedom. Cells
    with fewer than ``min_count`` draws in both samples together are pooled into one (the statistic is only
    chi-square distributed for well-filled cells)."""
    ca, cb = Counter(a), Counter(b)
    cells, rare_a, rare_b = [], 0, 0
    for c in set(ca) | set(cb):
        if ca[c] + cb[c] >= min_count:
            cells.append((ca[c], cb[c]))
        else:
            rare_a, rare_b = rare_a + ca[c], rare_b + cb[c]
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    return sum((x - y) ** 2 / (x + y) for x, y in cells), len(cells) - 1
