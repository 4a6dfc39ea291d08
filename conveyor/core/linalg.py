"""Small dense linear algebra in pure Python, for the online fits of ``core`` and ``sim`` (a handful of
coefficients over at most a few hundred samples: no numpy in the scheduler's import graph)."""

from __future__ import annotations


def solve(a: list[list[float]], b: list[float], tol: float = 1e-30) -> list[float] | None:
    """x with ``a @ x = b`` (Gauss-Jordan elimination with partial pivoting); None when a pivot's magnitude is
    below ``tol`` (singular, or too nearly so for the caller's scale)."""
    n = len(b)
    m = [list(row) + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < tol:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def least_squares(rows: list[tuple[float, ...]], ys: list[float], tol: float = 1e-12) -> list[float] | None:
    """The coefficients minimising the squared error of ``rows @ c`` against ``ys`` (the normal equations);
    None when they are not determined."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    return solve(a, b, tol)
