"""Calibration on a tiny real checkpoint: the grid produces the step shapes it promises, a trace's steps are
recorded, the fit and a profile round-trip through ``bench compare --simulate``; prediction errors by hand."""

from __future__ import annotations

import json

import pytest

from conveyor.bench.calibrate import Grid, measure_points, measure_workload, median_per_shape, profile_json, refit
from conveyor.bench.prediction import prediction_errors
from conveyor.bench.simulate import load_target, resolve_spec, spec_from_model_dir
from conveyor.engine.args import EngineArgs
from conveyor.sim import StepShape
from conveyor.sim.fit import fit_hardware
from conveyor.sim.hardware import Hardware


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from conveyor.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=str(tiny_llama_dir), policy="continuous", max_num_batched_tokens=4096,
                                num_kv_blocks=128, detokenize=False, debug_invariants=True))


def test_grid_times_the_shapes_it_promises(engine):
    grid = Grid(contexts=(8, 32), decodes=(1, 3), prefills=(5, 40), max_batch_context=64, decode_steps=2)
    points = measure_points(engine, grid)
    shapes = [s for s, _ in points]
    assert all(seconds > 0 for _, seconds in points)
    assert grid.batches() == [(1, 8), (3, 8), (1, 32)]  # 3 x 32 > max_batch_context
    assert len(points) == 3 * (1 + 2 + 2)
    # D=3, C=8: the batch's prefill, two decode-only steps, then a 5- and a 40-token prompt joining the decodes
    assert shapes[5:10] == [StepShape([(8, 0)] * 3, 3), StepShape([(1, 8)] * 3, 3), StepShape([(1, 9)] * 3, 3),
                            StepShape([(5, 0)] + [(1, 10)] * 3, 4), StepShape([(40, 0)] + [(1, 11)] * 3, 4)]
    assert not engine.has_unfinished_requests()  # the grid aborts what it started
    merged = median_per_shape(points + points)
    assert len(merged) == len(points)


def test_a_trace_run_yields_one_point_per_step(engine, tmp_path):
    from conveyor.bench.workload_gen import uniform

    workload = uniform(6, seed=3, prompt_len=(4, 30), output_len=(2, 6), vocab_size=384)
    points = measure_workload(engine, workload)
    assert sum(s.num_sampled for s, _ in points) == workload.num_output_tokens
    assert sum(q for s, _ in points for q, _ in s.rows) == workload.num_prompt_tokens + \
        workload.num_output_tokens - len(workload.requests)
    assert all(seconds > 0 for _, seconds in points)


def test_profile_round_trip(tiny_llama_dir, tmp_path):
    spec = spec_from_model_dir(str(tiny_llama_dir))
    assert (spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.intermediate_size) == (64, 2, 2, 128)
    base = Hardware("cpu", 1e10, 1e9, 1e10, dtype_bytes=4, link_bandwidth=0.0)
    # points from a known machine: a fresh fit must find them again, and refit must not change them
    true = base.with_overrides(matmul_efficiency=0.5, step_overhead_s=0.01, per_request_overhead_s=0.001)
    from conveyor.sim import RooflineCostModel

    shapes = [StepShape([(p, 0)] + [(1, c)] * d, 1 + d) for p in (4, 64, 256) for d in (0, 4, 16) for c in (8, 100)]
    points = [(s, RooflineCostModel(spec, true).step_time(s)) for s in shapes]
    report = fit_hardware(spec, base, points)
    profile = {"format": "conveyor-sim-profile/1", "model": spec.__dict__, "hardware": report.hardware.to_dict(),
               "fit": report.to_dict(), "points": [[s.to_list(), t] for s, t in points]}
    assert report.rms_rel_error < 0.02
    assert refit(profile)["fit"]["rms_rel_error"] == pytest.approx(report.rms_rel_error, abs=1e-9)
    path = tmp_path / "profile.json"
    path.write_text(profile_json(profile))
    assert json.loads(path.read_text()) == json.loads(json.dumps(profile))
    target = load_target(str(path))
    assert target.hardware == report.hardware and resolve_spec(None, target) == spec
    assert resolve_spec("llama-3-8b", target).name == "llama-3-8b"
    with pytest.raises(ValueError, match="not a conveyor simulation profile"):
        (tmp_path / "other.json").write_text("{}")
        load_target(str(tmp_path / "other.json"))


def test_prediction_errors():
    def doc(tok_s, ttft):
        return {"runs": [{"label": "chunked", "summary": {
            "output_throughput": tok_s, "ttft": {"p50": ttft, "p99": 2 * ttft}, "itl": {"p50": 0.02, "p99": 0.05},
            "e2e": {"p50": 1.0, "p99": 3.0}}}]}

    rows = prediction_errors(doc(200.0, 0.1), doc(180.0, 0.11))
    assert rows[0]["out tok/s"] == (200.0, 180.0, pytest.approx(-0.1))
    assert rows[0]["TTFT p50"][2] == pytest.approx(0.1) and rows[0]["ITL p50"][2] == 0.0
    with pytest.raises(ValueError, match="was not simulated"):
        prediction_errors(doc(1, 1), {"runs": []})
