"""conveyor's tests. Shared helpers live in ``tests.helpers``; ``pytest -m "not slow"`` is the fast inner loop."""
