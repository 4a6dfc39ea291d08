"""Scale-out on Ray Serve (optional): data-parallel conveyor replicas behind one OpenAI endpoint.

Nothing here is imported by a single-machine ``conveyor serve``; modules that need Ray import it at their top and
are only reached when ``--data-parallel-size`` > 1 (or ``--ray-address``) asks for them. ``affinity`` is pure
Python and needs no Ray.
"""

from __future__ import annotations

import re

ROUTER_NAMES = ("prefix", "pow2", "round-robin")  # --router choices (routers.ROUTERS implements them)
RAY_EXTRA_HINT = "pip install 'conveyor[ray]'  (Ray Serve 2.60)"


def require_ray() -> None:
    """Raise a clear error naming the extra when Ray Serve is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"data-parallel serving runs on Ray Serve, which is not installed ({exc}); install the "
                         f"extra: {RAY_EXTRA_HINT}") from None


def parse_disaggregate(spec: str) -> tuple[int, int]:
    """``--disaggregate``'s ``"1P1D"`` -> (1 prefill replica, 1 decode replica); ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", spec or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--disaggregate wants xPyD with x, y >= 1 (e.g. 1P1D), got {spec!r}")
    return int(m.group(1)), int(m.group(2))
