"""``/metrics`` for a pool of replicas: every replica's series with a ``replica`` label, and their sum without.

Each replica renders its own ``ServerMetrics`` (``replica.ReplicaReport.metrics_text``); here they are parsed and
merged. Counters, histograms and the running / waiting gauges are summed; ``kv_cache_usage_perc`` is averaged
(every replica has a cache of its own, so a sum above 1 would mean nothing). The numbers are as fresh as the
replicas' last reports (``replica.REPORT_PERIOD_S``).
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from conveyor.distributed.replica import ReplicaReport
from conveyor.server.metrics import P

AVERAGED = {P + "kv_cache_usage_perc"}


def merge_metrics(reports: list[ReplicaReport]) -> list[Metric]:
    """Metric families with one series per replica (label ``replica``) plus one summed series per label set."""
    merged: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for report in reports:
        for family in text_string_to_metric_families(report.metrics_text.decode()):
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue  # a creation timestamp: neither per replica nor summed means anything here
                target.add_sample(s.name, {**s.labels, "replica": report.replica_id}, s.value)
                totals[family.name][(s.name, tuple(sorted(s.labels.items())))].append(s.value)
    for name, series in totals.items():
        for (sample_name, labels), values in series.items():
            value = sum(values) / len(values) if name in AVERAGED else sum(values)
            merged[name].add_sample(sample_name, dict(labels), value)
    return list(merged.values())


class PoolMetrics:
    """What ``build_app`` and ``log_stats_forever`` read of ``ServerMetrics``, for a ``ReplicaPool``."""

    def __init__(self, pool) -> None:
        self.async_engine = pool

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.async_engine.reports)

    @property
    def total_generation_tokens(self) -> int:
        return sum(r.generation_tokens for r in self.async_engine.reports)

    def render(self) -> bytes:
        families = merge_metrics(self.async_engine.reports)
        registry = CollectorRegistry()
        registry.register(_Fixed(families))
        return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families
