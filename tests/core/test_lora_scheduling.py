"""LoRA adapters in the scheduler: at most ``max_loras`` distinct adapters among the running requests (a request of
another adapter waits at the queue head until one of them has no running request), and prefix-cache keys that
never match across adapters or between an adapter and the base model."""

from __future__ import annotations

from conveyor.core import SamplingParams
from conveyor.core.block_pool import ROOT_KEY
from conveyor.core.lora_request import LoRARequest, prefix_root
from tests.helpers.core import FakeExecutor, make_request, make_scheduler, step

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def test_a_third_adapter_waits_for_a_slot_then_runs():
    s = make_scheduler(max_loras=2)
    ex = FakeExecutor()
    s.add_request(make_request("a", max_tokens=2, lora=A))
    s.add_request(make_request("b", max_tokens=6, lora=B))
    s.add_request(make_request("c", max_tokens=2, lora=C))
    s.add_request(make_request("base", max_tokens=2))  # behind c: FCFS, nobody jumps the head of the queue
    out, _ = step(s, ex)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    s.check_invariants()
    while "a" in s.requests:
        out, _ = step(s, ex)
        assert "c" not in out.num_scheduled_tokens or "a" not in s.requests
        s.check_invariants()
    out, _ = step(s, ex)  # a finished: its slot is free, c (and the base request after it) join
    assert {"c", "base"} <= set(out.num_scheduled_tokens)
    s.check_invariants()


def test_requests_of_a_running_adapter_and_of_the_base_model_are_never_held_back():
    s = make_scheduler(max_loras=1)
    ex = FakeExecutor()
    for rid, lora in (("a1", A), ("base", None), ("a2", A)):
        s.add_request(make_request(rid, max_tokens=2, lora=lora))
    out, _ = step(s, ex)
    assert set(out.num_scheduled_tokens) == {"a1", "base", "a2"}


def test_prefix_cache_hits_only_within_one_adapter():
    s = make_scheduler(block_size=4)
    ex = FakeExecutor()
    s.add_request(make_request("a", prompt_len=10, max_tokens=1, lora=A))
    step(s, ex)
    for rid, lora in (("b", B), ("base", None)):  # the same prompt under another adapter and the base model: no hit
        s.add_request(make_request(rid, prompt_len=10, max_tokens=1, lora=lora))
        out, _ = step(s, ex)
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    s.add_request(make_request("a-again", prompt_len=10, max_tokens=1, lora=A))
    out, _ = step(s, ex)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8


def test_adapter_roots_differ_by_name_id_and_path():
    roots = {prefix_root(ROOT_KEY, lora) for lora in (None, A, LoRARequest("a", 9, A.lora_path),
                                                       LoRARequest("a", 1, "/elsewhere"), LoRARequest("ab", 1, "/x"),
                                                       LoRARequest("a", 1, "b/x"))}
    assert len(roots) == 6
    assert prefix_root(ROOT_KEY, None) == ROOT_KEY
    assert SamplingParams(lora=A).lora is A


def test_adapter_slots_admit_running_adapters_and_the_base_model_and_new_ones_while_a_slot_is_free():
    from conveyor.core.policies.adapter_slots import AdapterSlots

    slots = AdapterSlots(2)
    slots.begin([make_request("a", lora=A)])
    b, c, base, a2 = (make_request(rid, lora=lora) for rid, lora in (("b", B), ("c", C), ("base", None), ("a2", A)))
    assert slots.admits(b)
    slots.admitted(b)  # both slots taken now
    assert not slots.admits(c)
    assert slots.admits(base) and slots.admits(a2)
    slots.begin([make_request("b2", lora=B)])  # a new step: only B runs
    assert slots.admits(c)
