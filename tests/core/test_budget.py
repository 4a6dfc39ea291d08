"""``TokenBudget``: a step's tokens, and the share each request may take of them (the policy's chunking, KV
eviction's chunk cap, and the caps of the policy's ``StepYield``)."""

from conveyor.core import SchedulerConfig
from conveyor.core.budget import TokenBudget
from conveyor.core.kv_eviction import EvictionConfig, KVEvictor
from conveyor.core.policies import StepYield, make_policy
from tests.helpers.core import make_request


def budget(tokens: int = 64, whole: bool = False, evictor=None, yielded: StepYield = StepYield([]),
           **config) -> TokenBudget:
    policy = make_policy(SchedulerConfig(max_num_batched_tokens=tokens, max_model_len=1024, **config))
    return TokenBudget(policy, whole, evictor, yielded)


def test_a_decode_gets_one_token_and_a_prompt_a_chunk_of_what_is_left():
    b = budget(64)
    r = make_request("r")
    assert b.grant(r, 1) == 1
    assert b.grant(r, 100) == 64
    b.spend(60)
    assert b.grant(r, 100) == 4 and not b.exhausted
    b.spend(4)
    assert b.exhausted


def test_a_whole_prompt_runs_all_at_once_or_not_at_all():
    b = budget(64, whole=True)
    r = make_request("r")
    assert b.grant(r, 64) == 64
    assert b.grant(r, 65) == 0


def test_kv_eviction_caps_a_prompt_chunk_to_the_request_budget():
    evictor = KVEvictor(EvictionConfig(policy="sink", budget_tokens=64), block_size=4)
    b = budget(512, evictor=evictor)
    r = make_request("r", prompt_len=300)
    cap = evictor.chunk_cap(r)
    assert cap is not None and 1 <= cap < 300
    assert b.grant(r, 300) == cap
    assert b.grant(make_request("d", kv_budget_tokens=None), 300) == cap  # the engine's default budget


def test_running_caps_hold_a_request_back_and_leave_the_others():
    b = budget(64, yielded=StepYield([], caps={"held": 0, "slowed": 3}))
    assert b.grant(make_request("held"), 1) == 0
    assert b.grant(make_request("slowed"), 40) == 3
    assert b.grant(make_request("free"), 40) == 40
    assert b.grant(make_request("held"), 40, admitting=True) == 40  # caps are a running request's


def test_the_admission_cap_bounds_what_worse_priorities_take_in_all():
    b = budget(64, yielded=StepYield([], admit_cap=(0, 10)))
    urgent, batch = make_request("u", priority=0), make_request("b", priority=5)
    assert b.grant(urgent, 40, admitting=True) == 40  # not below the cap's priority
    assert b.grant(batch, 40, admitting=True) == 10
    assert b.grant(batch, 40) == 40  # running: not an admission
    b.spend(40, admitted=urgent)
    assert not b.closed_to(batch)
    b.spend(10, admitted=batch)
    assert b.closed_to(batch) and not b.closed_to(urgent)
    assert b.grant(batch, 40, admitting=True) == 0
