"""Configuration expansion of ``bench compare`` and the engine-side metrics, on hand-made step records."""

from types import SimpleNamespace

import pytest

from conveyor.bench.compare import expand_configs
from conveyor.bench.engine_metrics import assign_slots, engine_stats, slot_intervals


def test_sweeps_multiply_only_where_a_knob_matters():
    configs = expand_configs({"policies": ["static", "dynamic", "chunked"], "max_wait_ms": [0.0, 50.0],
                              "max_num_batched_tokens": [128, 512]})
    labels = [c.label for c in configs]
    assert labels == ["static", "dynamic wait=0", "dynamic wait=50", "chunked T=128", "chunked T=512"]
    assert dict(configs[2].overrides) == {"policy": "dynamic", "max_wait_ms": 50.0}


def test_request_rate_sweep_is_not_an_engine_override():
    configs = expand_configs({"policies": ["chunked"], "request_rate": [1.0, 4.0]})
    assert [c.request_rate for c in configs] == [1.0, 4.0]
    assert [c.label for c in configs] == ["chunked rate=1", "chunked rate=4"]
    assert all(dict(c.overrides) == {"policy": "chunked"} for c in configs)


def step(start, end, prefill=0, decode=0, pad=0, idle=0, reqs=1, running=1, reserved=0, stored=0, sched=None):
    return SimpleNamespace(start=start, end=end, num_prefill_tokens=prefill, num_decode_tokens=decode,
                           num_padding_tokens=pad, num_idle_slot_tokens=idle, num_reqs=reqs, num_running=running,
                           kv_reserved_slots=reserved, kv_stored_tokens=stored, kv_usage=0.5, num_preempted=0,
                           num_tokens=prefill + decode + pad, num_scheduled_tokens=sched or {})


def test_engine_stats_on_known_steps():
    steps = [step(0.0, 1.0, prefill=30, pad=10, reqs=2, running=2, reserved=100, stored=50),
             step(1.0, 4.0, decode=2, idle=1, reqs=2, running=2, reserved=100, stored=90)]
    s = engine_stats(steps, duration_s=4.0, model_flops=8e9, matmul_gflops=10.0, weight_bytes=1e9,
                     mem_bandwidth_gbs=1.0)
    assert s.computed_tokens == 42 and s.wasted_fraction == pytest.approx(11 / 42)
    assert s.kv_waste == pytest.approx((0.5 * 1 + 0.1 * 3) / 4)  # time-weighted 1 - stored / reserved
    assert s.peak_concurrency == 2 and s.mean_batch_size == 2 and s.mean_tokens_per_step == 21
    assert s.matmul_fraction == pytest.approx(0.2)  # 8 GFLOP / 4 s / 10 GFLOP/s
    assert s.bandwidth_fraction == pytest.approx(0.5)  # 2 steps x 1 GB / 4 s busy / 1 GB/s


def test_slot_assignment_reuses_freed_slots():
    scheduled = [{"a": 5, "b": 5}, {"a": 1, "b": 1}, {"b": 1, "c": 4}, {"c": 1}]
    spans = slot_intervals(scheduled)
    assert spans == {"a": (0, 1), "b": (0, 2), "c": (2, 3)}
    assert assign_slots(spans) == {"a": 0, "b": 1, "c": 0}
