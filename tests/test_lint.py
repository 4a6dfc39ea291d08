"""Pyflakes' checks over the code base: an unused local or import, a shadowed import or an undefined name is
usually a half-finished edit, so it fails the suite rather than waiting for a reviewer."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyflakes_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--output-format", "concise",
                             "--no-cache", "conveyor", "tests", "benchmarks", "scripts"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
