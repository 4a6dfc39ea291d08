"""SLO-aware admission's prediction (core/admission.py): service classes parsed, step times fitted online, and TTFT /
TPOT that follow the queue ahead, the budget and the decodes."""

from __future__ import annotations

import pytest

from conveyor.core.admission import (
    EngineShape, InFlight, OnlineStepTime, Prediction, ServiceClass, predict, retry_after_s,
)

SHAPE = EngineShape(max_num_batched_tokens=256, max_num_seqs=8)


def linear(fixed: float = 0.01, per_token: float = 0.0001, chunk: float = 0.002) -> OnlineStepTime:
    """Step times fitted from steps that cost exactly fixed + per_token x tokens (+ chunk with a prompt chunk)."""
    step = OnlineStepTime()
    for tokens in (1, 4, 16, 64, 256):
        step.observe(tokens, fixed + per_token * tokens, False)
        step.observe(tokens + 32, fixed + per_token * (tokens + 32) + chunk, True)
    return step


def test_service_class_specs():
    c = ServiceClass.parse("interactive:ttft=500,tpot=50,priority=-1,demote=flex")
    assert c == ServiceClass("interactive", 0.5, 0.05, -1, "flex") and c.has_targets
    assert ServiceClass.parse("flex:priority=5") == ServiceClass("flex", priority=5) and not ServiceClass("b").has_targets
    assert c.meets(0.4, 0.05) and not c.meets(0.6, 0.01) and not c.meets(0.1, 0.06) and c.meets(0.1, None)
    for bad in ("", ":ttft=5", "x:ttft=-1", "x:ttft=fast", "x:latency=5", "x:ttft"):
        with pytest.raises(ValueError, match="service class"):
            ServiceClass.parse(bad)


def test_online_step_time_is_unknown_until_two_sizes_then_fits_the_line():
    step = OnlineStepTime()
    assert step.seconds(10, 1, False) is None
    step.observe(8, 0.018, False)
    assert step.seconds(10, 1, False) is None
    fitted = linear()
    assert fitted.seconds(100, 4, False) == pytest.approx(0.02, rel=1e-6)
    assert fitted.seconds(100, 4, True) == pytest.approx(0.022, rel=1e-6)


def test_an_idle_engine_predicts_one_prompt_step_then_decode_steps():
    p = predict([], 0, 0.0, 100, 11, SHAPE, linear())
    assert p.ttft_s == pytest.approx(0.01 + 0.01 + 0.002)  # the prompt's step (100 tokens + chunk)
    assert p.tpot_s == pytest.approx(0.0101)  # a step of its one decode
    assert predict([], 0, 0.0, 100, 1, SHAPE, linear()).tpot_s is None


def test_prompts_ahead_delay_the_first_token_by_full_steps_and_lower_priorities_do_not():
    alone = predict([], 0, 5.0, 100, 10, SHAPE, linear())
    ahead = [InFlight(0, 1.0, 1000, 50)]  # 1000 prompt tokens queued before it, same priority, earlier
    queued = predict(ahead, 0, 5.0, 100, 10, SHAPE, linear())
    full = 0.01 + 0.0001 * 256 + 0.002
    # 1100 tokens through 256 a step: 4 full steps, then 76 tokens; plus half the step running now
    assert queued.ttft_s == pytest.approx(full / 2 + 4 * full + (0.01 + 0.0001 * 76 + 0.002))
    behind = predict([InFlight(9, 1.0, 1000, 50)], 0, 5.0, 100, 10, SHAPE, linear())
    later = predict([InFlight(0, 9.0, 1000, 50)], 0, 5.0, 100, 10, SHAPE, linear())
    assert behind.ttft_s < queued.ttft_s and later.ttft_s < queued.ttft_s
    # ... but a lower priority's prompt fills the steps of its decode: its TPOT grows
    assert behind.tpot_s > alone.tpot_s


def test_decodes_take_budget_and_a_full_batch_waits_for_a_seat():
    decoding = [InFlight(0, float(i), 0, 20) for i in range(8)]
    p = predict(decoding, 0, 10.0, 500, 10, SHAPE, linear())
    no_seat_wait = predict(decoding[:7], 0, 10.0, 500, 10, SHAPE, linear())
    assert p.ttft_s > no_seat_wait.ttft_s  # all 8 seats taken: it waits ~20 steps for the first to finish
    outranked = [InFlight(5, float(i), 0, 20) for i in range(8)]
    assert predict(outranked, 0, 10.0, 500, 10, SHAPE, linear()).ttft_s < p.ttft_s  # it takes a lower one's seat


def test_a_waiting_request_counts_what_it_already_waited_and_retry_after_says_how_far_over():
    p = predict([], 0, 0.0, 10, 5, SHAPE, linear(), elapsed_s=2.0)
    assert p.ttft_s > 2.0
    assert retry_after_s(Prediction(3.4, None), ServiceClass("i", ttft_s=0.5)) == 3
    assert retry_after_s(Prediction(0.6, None), ServiceClass("i", ttft_s=0.5)) == 1
    assert predict([], 0, 0.0, 10, 5, SHAPE, OnlineStepTime()) is None
