"""How a simulated cluster's GPUs are split into instances: ``2C@4``, ``1P1D@4``, ``4P4D@1``, ``2P1D@2/4``. PURE PYTHON.

Grammar: ``<n>C[@tp]`` is n colocated instances (each runs prefill and decode, chunked prefill as configured);
``<x>P<y>D[@tp | @tp_prefill/tp_decode]`` is x prefill and y decode instances. Without ``@``, every instance gets
the default tensor-parallel size (``--tensor-parallel-size``). ``gpus`` is what the layout occupies, so layouts
compared in one table can be checked to use the same number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"^(?:(?P<c>\d+)C|(?P<p>\d+)P(?P<d>\d+)D)(?:@(?P<tp1>\d+)(?:/(?P<tp2>\d+))?)?$", re.IGNORECASE)


@dataclass(frozen=True)
class Layout:
    """Instances of a cluster: counts per role and the TP of each role."""

    num_colocated: int = 0
    num_prefill: int = 0
    num_decode: int = 0
    tp_colocated: int = 1
    tp_prefill: int = 1
    tp_decode: int = 1

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    @property
    def gpus(self) -> int:
        return (self.num_colocated * self.tp_colocated + self.num_prefill * self.tp_prefill
                + self.num_decode * self.tp_decode)

    @property
    def label(self) -> str:
        if not self.disaggregated:
            return f"{self.num_colocated}C@{self.tp_colocated}"
        tp = f"{self.tp_prefill}" if self.tp_prefill == self.tp_decode else f"{self.tp_prefill}/{self.tp_decode}"
        return f"{self.num_prefill}P{self.num_decode}D@{tp}"

    def describe(self) -> str:
        if not self.disaggregated:
            return f"{self.num_colocated} colocated x TP{self.tp_colocated} ({self.gpus} GPUs)"
        return (f"{self.num_prefill} prefill x TP{self.tp_prefill} + {self.num_decode} decode x TP{self.tp_decode} "
                f"({self.gpus} GPUs)")


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
        layout = Layout(num_colocated=int(m["c"]), tp_colocated=tp1)
    else:
        layout = Layout(num_prefill=int(m["p"]), num_decode=int(m["d"]), tp_prefill=tp1, tp_decode=tp2)
    counts = [layout.num_colocated] if m["c"] is not None else [layout.num_prefill, layout.num_decode]
    if min(counts) < 1 or min(tp1, tp2) < 1:
        raise ValueError(f"bad layout {text!r}: every count and TP size must be at least 1")
    return layout
