"""A request handed over with its KV already computed (a disaggregated prefill's decode side) is admitted as a
decode: blocks for all its tokens, one token scheduled, and its preset count kept. A preempted one recomputes."""

from conveyor.core import RequestStatus
from tests.helpers.core import FakeExecutor, make_request, make_scheduler, step


def handed_over(rid: str, prompt_len: int, max_tokens: int):
    """The decode side's copy: the prompt's KV computed elsewhere, and the first token already sampled there."""
    r = make_request(rid, prompt_len=prompt_len, max_tokens=max_tokens)
    r.output_token_ids.append(7)
    r.num_computed_tokens = prompt_len
    return r


def test_handed_over_request_is_admitted_as_a_decode():
    s = make_scheduler(num_blocks=16, block_size=4)
    s.add_request(handed_over("a", prompt_len=10, max_tokens=3))
    out, updates = step(s, FakeExecutor())
    assert out.num_scheduled_tokens == {"a": 1}
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 10 and len(new.token_ids) == 11
    assert len(new.block_ids) == 3  # 11 tokens in blocks of 4: the prompt's 3 blocks, the first token's slot
    assert len(updates) == 1 and not updates[0].finished
    assert s.requests["a"].num_output_tokens == 2 and s.requests["a"].num_cached_prompt_tokens == 0


def test_handed_over_request_finishes_after_its_remaining_tokens():
    s = make_scheduler(num_blocks=16, block_size=4)
    s.add_request(handed_over("a", prompt_len=10, max_tokens=3))
    ex = FakeExecutor()
    scheduled = []
    while s.has_unfinished_requests():
        out, _ = step(s, ex)
        scheduled.append(out.num_scheduled_tokens.get("a"))
    assert scheduled == [1, 1]  # tokens 2 and 3: the first came from the prefill side
    assert s.kv.usage() == 0.0


def test_preempted_handed_over_request_recomputes_everything():
    s = make_scheduler(num_blocks=3, block_size=4)  # 12 slots: "a" (11 tokens) fills them at its second token
    a = handed_over("a", prompt_len=10, max_tokens=8)
    s.add_request(a)
    ex = FakeExecutor()
    step(s, ex)
    step(s, ex)  # 12 tokens: the 3 blocks are full
    out, _ = step(s, ex)  # the 13th needs a 4th block: "a" preempts itself
    assert "a" in out.preempted_req_ids and a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
