"""``core.linalg``: the small solves behind the speculation cost fit and the simulator's calibration."""

from __future__ import annotations

import pytest

from conveyor.core.linalg import least_squares, solve


def test_solve_needs_pivoting_and_reports_a_singular_system():
    assert solve([[0.0, 2.0], [3.0, 1.0]], [4.0, 5.0]) == pytest.approx([1.0, 2.0])  # a zero first pivot
    assert solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) is None


def test_least_squares_recovers_exact_coefficients_and_refuses_an_undetermined_fit():
    rows = [(1.0, x, float(x % 2)) for x in range(8)]
    ys = [0.004 + 0.0015 * x + 0.001 * m for _, x, m in rows]
    assert least_squares(rows, ys) == pytest.approx([0.004, 0.0015, 0.001])
    assert least_squares([(1.0, 3.0), (1.0, 3.0)], [1.0, 2.0]) is None  # one size: no slope
