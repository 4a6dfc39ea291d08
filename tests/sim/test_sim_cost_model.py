"""Cost models on hand-computed FLOPs and bytes, the model table against the published parameter counts and the
real model code, the executor's view of who samples, and the calibration fit on points of a known machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.core.sampling_params import SamplingParams
from conveyor.sim import (
    ConstantCostModel,
    Hardware,
    ModelSpec,
    RooflineCostModel,
    SequenceTracker,
    StepShape,
    get_hardware,
    get_model_spec,
)
from conveyor.sim.fit import fit_hardware, nonnegative_least_squares

# hidden 8, 2 layers, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 10
TOY = ModelSpec("toy", hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                vocab_size=10, max_position_embeddings=64, tie_word_embeddings=False)
# 1000 FLOP/s, 100 B/s, everything at 100%, no overheads: times are FLOPs / 1000 or bytes / 100
UNIT = Hardware("unit", peak_flops=1000.0, mem_bandwidth=100.0, memory_bytes=1e9, dtype_bytes=2,
                link_bandwidth=50.0, matmul_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0,
                link_efficiency=1.0, allreduce_latency_s=0.5, step_overhead_s=0.0, per_request_overhead_s=0.0)


def test_toy_model_counts():
    # q/k/v: 8 x (8 + 4 + 4) = 128; o: 8 x 8 = 64; gate, up, down: 3 x 8 x 16 = 384
    assert TOY.linear_params_per_layer == 576
    assert TOY.per_token_linear_params == 1152
    assert TOY.lm_head_params == 80
    assert TOY.num_params == 2 * (576 + 16) + 2 * 80 + 8  # layers with norms, embedding + lm_head, final norm


def test_roofline_on_a_hand_computed_step():
    # a 3-token prompt from scratch, and a decode with 5 tokens cached; both sample
    shape = StepShape(rows=[(3, 0), (1, 5)], num_sampled=2)
    cost = RooflineCostModel(TOY, UNIT)
    ops = cost.op_counts(shape)
    assert ops.linear.flops == 2 * 1152 * 4 == 9216
    assert ops.linear.bytes == 1152 * 2  # the weights, once
    # prefill: 0 + 1 + 2 + 3 ... token i sees i + 1 keys: 1 + 2 + 3 = 6 pairs; 4 x q_dim 8 x 2 layers per pair
    assert ops.prefill_attn.flops == 6 * 64
    kv_per_token = 2 * 2 * 1 * 4 * 2  # K and V, 2 layers, 1 KV head of 4, 2 bytes = 32
    assert ops.prefill_attn.bytes == 3 * kv_per_token
    assert ops.decode_attn.flops == 6 * 64 and ops.decode_attn.bytes == 6 * kv_per_token  # 5 cached + itself
    assert ops.lm_head.flops == 2 * 80 * 2 and ops.lm_head.bytes == 160
    # every op is memory-bound here: 23.04 + 0.96 + 1.92 + 1.6 seconds
    assert cost.step_time(shape) == pytest.approx(2304 / 100 + 96 / 100 + 192 / 100 + 160 / 100)
    c = cost.step_cost(shape)
    assert c.flops == 9216 + 384 + 384 + 320 and c.bytes == 2304 + 96 + 192 + 160


def test_an_int8_kv_cache_is_a_byte_a_value_plus_a_scale_per_row():
    """``--kv-cache-dtype int8``: each (token, head) row is head_dim bytes and a float32 scale, in the cache's size
    and in what decode attention reads."""
    shape = StepShape(rows=[(1, 5)], num_sampled=1)
    int8 = RooflineCostModel(TOY, UNIT, kv_cache_dtype="int8")
    assert int8.kv_bytes_per_token() == 2 * 2 * 1 * (4 + 4)  # K and V, 2 layers, 1 KV head: 4 values + scale
    assert int8.op_counts(shape).decode_attn.bytes == 6 * int8.kv_bytes_per_token()
    llama = get_model_spec("llama-3-8b")  # head_dim 128: 132 bytes a row against bfloat16's 256
    ratio = RooflineCostModel(llama, UNIT).kv_bytes_per_token() / \
        RooflineCostModel(llama, UNIT, kv_cache_dtype="int8").kv_bytes_per_token()
    assert ratio == pytest.approx(256 / 132)


def test_a_bfloat16_kv_cache_under_float32_weights_is_two_bytes_a_value():
    """``--kv-cache-dtype bfloat16`` with 4-byte weights: the cache and decode attention's reads at 2 bytes a value."""
    shape = StepShape(rows=[(1, 5)], num_sampled=1)
    fp32 = RooflineCostModel(TOY, UNIT, dtype_bytes=4)
    half = RooflineCostModel(TOY, UNIT, dtype_bytes=4, kv_cache_dtype="bfloat16")
    assert fp32.kv_bytes_per_token() == 2 * 2 * 1 * 4 * 4 and half.kv_bytes_per_token() == 2 * 2 * 1 * 4 * 2
    assert half.op_counts(shape).decode_attn.bytes == 6 * half.kv_bytes_per_token()
    assert "bfloat16 KV" in half.describe()


def test_compute_bound_prefill_and_overheads():
    hw = UNIT.with_overrides(peak_flops=10.0, step_overhead_s=1.0, per_request_overhead_s=0.5,
                             per_token_overhead_s=0.25)
    shape = StepShape(rows=[(4, 2)], num_sampled=1)
    # linear 2 x 1152 x 4 = 9216 FLOP at 10 FLOP/s = 921.6 s > 2304 B / 100; attention: 4 x 2 + 10 = 18 pairs
    # x 64 = 1152 FLOP = 115.2 s > 6 tokens x 32 B; lm_head 160 FLOP = 16 s; overheads 1 + 0.5 + 4 x 0.25
    expected = 921.6 + 115.2 + 16.0 + 1.0 + 0.5 + 1.0
    assert RooflineCostModel(TOY, hw).step_time(shape) == pytest.approx(expected)


def test_padding_runs_as_causal_segments_of_the_longest_chunk():
    shape = StepShape(rows=[(4, 0), (2, 0)], num_sampled=2, num_padding_tokens=2 + 4 + 1)
    ops = RooflineCostModel(TOY, UNIT).op_counts(shape)
    assert ops.linear.flops == 2 * 1152 * 13
    pairs = (4 * 5 // 2) + (2 * 3 // 2) + (4 * 5 // 2) + (3 * 4 // 2)  # rows, then pad: one 4-segment and a 3
    assert ops.prefill_attn.flops == pairs * 64


def test_tensor_parallel_splits_work_and_adds_all_reduces():
    shape = StepShape(rows=[(1, 3), (1, 7)], num_sampled=2)
    one, two = RooflineCostModel(TOY, UNIT), RooflineCostModel(TOY, UNIT, tensor_parallel_size=2)
    a, b = one.op_counts(shape), two.op_counts(shape)
    assert b.linear.flops == a.linear.flops / 2 and b.linear.bytes == a.linear.bytes / 2
    assert b.decode_attn.flops == a.decode_attn.flops / 2
    assert b.decode_attn.bytes == a.decode_attn.bytes  # one KV head: replicated on both devices
    assert b.num_allreduces == 4 and b.allreduce_bytes == 2 * 8 * 2  # 2 per layer; 2 tokens x hidden x 2 B
    # each all-reduce: 0.5 s latency + ring 2 x (2 - 1) / 2 x 32 B / 50 B/s
    assert two.op_seconds(b) - two.op_seconds(b.__class__(**{**_fields(b), "num_allreduces": 0})) == \
        pytest.approx(4 * (0.5 + 32 / 50))
    assert two.step_cost(shape).flops == pytest.approx(one.step_cost(shape).flops)  # totals over devices


def _fields(ops) -> dict:
    return {name: getattr(ops, name) for name in ops.__slots__}


def test_tensor_parallel_needs_a_link():
    with pytest.raises(ValueError, match="tensor parallelism"):
        RooflineCostModel(TOY, UNIT.with_overrides(link_bandwidth=0.0), tensor_parallel_size=2)


@pytest.mark.parametrize("name, params", [("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496),
                                          ("qwen2.5-7b", 7_615_616_512), ("smollm2-135m", 134_515_008),
                                          ("qwen3-30b-a3b", 30_532_122_624)])
def test_model_table_matches_published_parameter_counts(name, params):
    spec = get_model_spec(name)
    extra = 0
    if name == "qwen2.5-7b":  # q/k/v biases, which the linear count (FLOPs per token) leaves out
        extra = spec.num_layers * (spec.q_dim + 2 * spec.kv_dim)
    if name == "qwen3-30b-a3b":  # q/k norms, which neither counts
        extra = spec.num_layers * 2 * spec.head_dim
    assert spec.num_params + extra == params


def test_a_mixture_counts_the_experts_a_token_runs():
    """Qwen3-30B-A3B: 3.3B parameters a token (its name's A3B) of 30.5B; a step of 64 decodes reads nearly all
    128 experts of a layer, one of a token its own 8."""
    spec = get_model_spec("qwen3-30b-a3b")
    assert spec.per_token_linear_params + 2 * spec.lm_head_params == pytest.approx(3.35e9, rel=0.01)
    assert spec.experts_touched(1) == 8 and spec.experts_touched(64) == pytest.approx(125.9, abs=0.1)
    assert spec.step_linear_params(64) < 64 * spec.step_linear_params(1) / 4


def test_bench_model_spec_matches_the_real_model():
    from conveyor.bench.offline import model_flops, workload_work
    from conveyor.models.embedded import load_embedded
    model, info = load_embedded()
    spec = get_model_spec(info.name)
    # the loaded model's spec (from its config) is the table's, and counts the weights its layers really hold
    layer_weights = sum(p.numel() for name, p in model.named_parameters()
                        if p.dim() == 2 and not name.startswith(("embed_tokens", "lm_head")))
    assert info.spec.per_token_linear_params == spec.per_token_linear_params == layer_weights
    assert spec.num_params == info.num_params
    assert spec.forward_flops(*workload_work(15702, 8861, 100)) == pytest.approx(
        model_flops(info, 15702, 8861, 100))


def test_tracker_knows_who_samples():
    params = SamplingParams(max_tokens=4)
    tracker = SequenceTracker()
    # a: 10-token prompt chunked 6 + 4; b: a 3-token prompt whole
    so = SchedulerOutput([NewRequestData("a", list(range(10)), 10, params, [0], 0),
                          NewRequestData("b", [1, 2, 3], 3, params, [1], 0)], [], {"a": 6, "b": 3}, 9)
    shape, samplers = tracker.shape_of(so)
    assert shape.rows == [(6, 0), (3, 0)] and samplers == ["b"] and shape.num_sampled == 1
    so = SchedulerOutput([], [CachedRequestData("a", [], 6), CachedRequestData("b", [], 3)], {"a": 4, "b": 1}, 5)
    shape, samplers = tracker.shape_of(so)
    assert shape.rows == [(4, 6), (1, 3)] and samplers == ["a", "b"]
    so = SchedulerOutput([], [CachedRequestData("a", [], 10)], {"a": 1}, 1, finished_req_ids={"b"})
    assert tracker.shape_of(so)[1] == ["a"] and "b" not in tracker.num_tokens


def test_constant_model():
    assert ConstantCostModel(0.02).step_time(StepShape([(100, 0)], 1)) == 0.02
    with pytest.raises(ValueError):
        ConstantCostModel(0.0)


def test_hardware_table_and_errors():
    h100 = get_hardware("H100-SXM")
    assert h100.peak_flops == 989e12 and h100.mem_bandwidth == 3350e9
    assert Hardware.from_dict(h100.to_dict()) == h100
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu")
    with pytest.raises(ValueError, match="unknown model"):
        get_model_spec("gpt-5")


def test_nonnegative_least_squares_drops_a_negative_coefficient():
    features = [[1.0, x] for x in range(6)]
    assert nonnegative_least_squares(features, [2.0 + 3.0 * x for x in range(6)], [1.0] * 6) == \
        pytest.approx([2.0, 3.0])
    x = nonnegative_least_squares(features, [5.0 - 0.1 * x for x in range(6)], [1.0] * 6)
    assert x[1] == 0.0 and x[0] == pytest.approx(4.75)  # the best constant under a falling line


def test_fit_recovers_a_known_machine():
    spec = get_model_spec("bench-llama-40m")
    true = Hardware("cpu", 100e9, 20e9, 1e10, dtype_bytes=4, matmul_efficiency=0.6, attention_efficiency=0.3,
                    memory_efficiency=0.5, step_overhead_s=3e-3, per_request_overhead_s=50e-6,
                    per_token_overhead_s=2e-6)
    shapes = [StepShape([(p, 0)] * r + [(1, c)] * d, r + d) for p in (16, 512) for r in (1, 2)
              for d in (0, 8, 32) for c in (64, 1024)]
    points = [(s, RooflineCostModel(spec, true).step_time(s)) for s in shapes]
    start = true.with_overrides(matmul_efficiency=1.0, attention_efficiency=1.0, memory_efficiency=1.0,
                                step_overhead_s=0.0, per_request_overhead_s=0.0, per_token_overhead_s=0.0)
    report = fit_hardware(spec, start, points)
    assert report.rms_rel_error < 0.01
    assert report.hardware.matmul_efficiency == pytest.approx(0.6, rel=0.05)
    assert report.hardware.step_overhead_s == pytest.approx(3e-3, rel=0.1)


def test_sim_imports_no_torch():
    code = ("import sys, conveyor.sim, conveyor.sim.fit, conveyor.sim.loop\n"
            "bad = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bench_compare_simulate_writes_the_real_report(tmp_path):
    """`bench compare --simulate` on a hardware name: the same files and results schema as a real run."""
    from conveyor.bench.workload_gen import longtail
    from conveyor.cli import main

    trace = tmp_path / "trace.json"
    longtail(30, seed=4, rate=20.0).save(trace)
    out = tmp_path / "out"
    assert main(["bench", "compare", "--workload", str(trace), "--simulate", "h100-sxm", "--model", "llama-3-8b",
                 "--policies", "static,chunked", "--max-num-seqs", "8", "--kv-cache-memory", "16",
                 "--out", str(out)]) == 0
    import json

    results = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in results["runs"]] == ["static", "chunked"]
    static, chunked = results["runs"]
    for run in results["runs"]:
        assert run["summary"]["num_completed"] == 30 and run["summary"]["output_throughput"] > 0
        assert set(run) >= {"summary", "engine", "timings", "steps", "overrides", "num_kv_blocks"}
        assert 0 < run["sim"]["mfu"] < 1 and 0 < run["sim"]["mbu"] < 1
    assert static["engine"]["wasted_fraction"] > 0 == chunked["engine"]["wasted_fraction"]
    assert results["simulated"]["hardware"]["name"] == "h100-sxm" and results["model"] == "llama-3-8b"
    assert (out / "report.md").read_text().count("SIMULATED") == 1
    assert (out / "latency_cdfs.png").is_file() and (out / "slots_static.png").is_file()


def test_simulation_refuses_what_does_not_fit(tmp_path, capsys):
    from conveyor.bench.workload_gen import longtail
    from conveyor.cli import main

    trace = tmp_path / "trace.json"
    longtail(4, seed=4, rate=20.0).save(trace)
    # the command line ends with one line naming the reason (exit 1), not a traceback
    assert main(["bench", "compare", "--workload", str(trace), "--simulate", "h100-sxm", "--model", "llama-3-70b",
                 "--kv-cache-memory", "10", "--out", str(tmp_path / "o"), "--no-plots"]) == 1
    assert "exceed h100-sxm" in capsys.readouterr().err
    assert main(["bench", "compare", "--workload", str(trace), "--simulate", "h100-sxm", "--model", "llama-3-70b",
                 "--tensor-parallel-size", "8", "--kv-cache-memory", "1", "--out", str(tmp_path / "o"),
                 "--no-plots"]) == 1
    assert "KV cache too small" in capsys.readouterr().err


def test_a_scheduler_that_can_never_schedule_is_reported_not_spun_forever():
    from conveyor.core import Request, Scheduler, SchedulerConfig
    from conveyor.core.kv_manager import KVCacheManager
    from conveyor.sim import SimExecutor, simulate

    # 2 blocks of 4 tokens cannot hold a 20-token prompt: the request waits at the head of the queue forever
    scheduler = Scheduler(SchedulerConfig(policy="continuous", max_model_len=64), KVCacheManager(2, 4))
    request = Request("r", list(range(3, 23)), SamplingParams(max_tokens=2, ignore_eos=True), (), 64, 0.0)
    with pytest.raises(RuntimeError, match="livelock"):
        simulate(scheduler, SimExecutor(ConstantCostModel(0.01)), [request], max_idle_polls=1000)
