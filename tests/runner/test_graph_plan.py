"""The decode-graph bookkeeping: the captured sizes, the padded size a step replays, and which steps run eagerly."""

from __future__ import annotations

import sys

import pytest

from conveyor.runner.graph_plan import DecodeGraphPlan, StepShape, capture_sizes


def test_capture_sizes_cover_every_batch_up_to_the_maximum():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    sizes = capture_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 4 + 16
    assert list(sizes) == sorted(set(sizes))
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize("max_num_seqs", [1, 7, 16, 100, 256])
def test_every_decode_batch_replays_the_smallest_size_that_holds_it(max_num_seqs):
    plan = DecodeGraphPlan(max_num_seqs)
    for n in range(1, max_num_seqs + 1):
        choice = plan.choose(StepShape(num_reqs=n, num_tokens=n))
        smaller = [s for s in plan.sizes if s < choice.size]
        assert choice.size >= n and (not smaller or smaller[-1] < n), (n, choice)
        assert choice.padding == choice.size - n
        assert choice.padding < max(16, n)  # the ladder's promise: within 16 rows, or below a factor 2
    over = plan.choose(StepShape(num_reqs=max_num_seqs + 1, num_tokens=max_num_seqs + 1))
    assert over.size is None and "largest captured size" in over.reason


@pytest.mark.parametrize("shape,reason", [
    (StepShape(num_reqs=3, num_tokens=10), "not one token per request"),  # a prompt chunk rides along
    (StepShape(num_reqs=3, num_tokens=3, num_spec_rows=1), "not one token per request"),
    (StepShape(num_reqs=3, num_tokens=3, num_padding_tokens=2), "pad rows"),
    (StepShape(num_reqs=3, num_tokens=3, scored=True), "KV eviction"),
    (StepShape(num_reqs=3, num_tokens=3, lora=True), "LoRA"),
    (StepShape(num_reqs=3, num_tokens=3, pooling=True), "pooling"),
    (StepShape(num_reqs=3, num_tokens=3, prompt_logprobs=True), "prompt logprobs"),
    (StepShape(num_reqs=0, num_tokens=0), "empty"),
])
def test_steps_that_run_eagerly_say_why(shape, reason):
    choice = DecodeGraphPlan(64).choose(shape)
    assert choice.size is None and choice.padding == 0 and reason in choice.reason


def test_enforce_eager_captures_and_replays_nothing():
    plan = DecodeGraphPlan(64, enforce_eager=True)
    assert plan.sizes == () and plan.padded_size(1) is None
    assert plan.choose(StepShape(num_reqs=1, num_tokens=1)).reason == "enforce_eager"


def test_the_plan_imports_no_torch():
    """Pure bookkeeping: the module imports only the standard library (its package, the runner, is torch's)."""
    import ast

    import conveyor.runner.graph_plan as plan

    tree = ast.parse(open(plan.__file__).read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
