"""How a simulated cluster's GPUs are split into instances: ``2C@4``, ``1P1D@4``, ``4P4D@1``, ``2P1D@2/4``. PURE PYTHON.

Grammar: ``<n>C[@tp]`` is n colocated instances (each runs prefill and decode, chunked prefill as configured);
``<x>P<y>D[@tp | @tp_prefill/tp_decode]`` is x prefill and y decode instances. Without ``@``, every instance gets
the default tensor-parallel size (``--tensor-parallel-size``). ``gpus`` is what the layout occupies, so layouts
compared in one table can be checked to use the same number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from conveyor.sim.instance import COLOCATED, DECODE, PREFILL

_SPEC = re.compile(r"^(?:(?P<c>\d+)C|(?P<p>\d+)P(?P<d>\d+)D)(?:@(?P<tp1>\d+)(?:/(?P<tp2>\d+))?)?$", re.IGNORECASE)


@dataclass(frozen=True)
class Instances:
    """``count`` instances of one role, each tensor-parallel over ``tp`` GPUs."""

    count: int = 0
    tp: int = 1

    @property
    def gpus(self) -> int:
        return self.count * self.tp


@dataclass(frozen=True)
class Layout:
    """Instances of a cluster, per role: colocated ones (prefill and decode), or prefill and decode ones."""

    colocated: Instances = Instances()
    prefill: Instances = Instances()
    decode: Instances = Instances()

    @property
    def disaggregated(self) -> bool:
        return self.prefill.count > 0

    @property
    def gpus(self) -> int:
        return self.colocated.gpus + self.prefill.gpus + self.decode.gpus

    def roles(self) -> list[tuple[str, int]]:
        """(role, TP) of every instance (``sim.instance``'s role names): colocated ones, prefill, then decode."""
        groups = ((COLOCATED, self.colocated), (PREFILL, self.prefill), (DECODE, self.decode))
        return [(role, group.tp) for role, group in groups for _ in range(group.count)]

    @property
    def label(self) -> str:
        if not self.disaggregated:
            return f"{self.colocated.count}C@{self.colocated.tp}"
        p, d = self.prefill, self.decode
        return f"{p.count}P{d.count}D@{p.tp if p.tp == d.tp else f'{p.tp}/{d.tp}'}"

    def describe(self) -> str:
        if not self.disaggregated:
            return f"{self.colocated.count} colocated x TP{self.colocated.tp} ({self.gpus} GPUs)"
        return (f"{self.prefill.count} prefill x TP{self.prefill.tp} + {self.decode.count} decode x "
                f"TP{self.decode.tp} ({self.gpus} GPUs)")


def parse_layout(text: str, default_tp: int = 1) -> Layout:
    """``2C@4`` -> 2 colocated TP4 instances; ``1P1D@4`` -> 1 prefill + 1 decode, TP4 each; see the module doc."""
    m = _SPEC.match(text.strip())
    if m is None:
        raise ValueError(f"bad layout {text!r}: use <n>C[@tp] (colocated) or <x>P<y>D[@tp[/tp_decode]], "
                         "e.g. 2C@4, 1P1D@4, 4P4D@1, 2P1D@2/4")
    tp1 = int(m["tp1"]) if m["tp1"] else default_tp
    tp2 = int(m["tp2"]) if m["tp2"] else tp1
    if m["c"] is not None:
        if m["tp2"]:
            raise ValueError(f"bad layout {text!r}: a colocated layout has one TP size")
        layout = Layout(colocated=Instances(int(m["c"]), tp1))
    else:
        layout = Layout(prefill=Instances(int(m["p"]), tp1), decode=Instances(int(m["d"]), tp2))
    counts = [layout.colocated.count] if m["c"] is not None else [layout.prefill.count, layout.decode.count]
    if min(counts) < 1 or min(tp1, tp2) < 1:
        raise ValueError(f"bad layout {text!r}: every count and TP size must be at least 1")
    return layout
