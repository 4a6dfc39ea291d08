"""SLO-aware admission against a real server: a request that cannot meet its class's TTFT target is refused at
once (429, Retry-After, OpenAI's and Anthropic's shapes, streamed or not), moved to the lower class its client
allowed with ``service_tier: auto``, and counted per class; a waiting request judged again and refused."""

from __future__ import annotations

import asyncio
import time

import anthropic
import httpx
import openai
import pytest

from prometheus_client import CollectorRegistry

from conveyor.bench.mixed_http import scrape, server_refusal_time
from conveyor.core.admission import EngineShape, OnlineStepTime, ServiceClass
from conveyor.server.admission import AdmissionController, ServiceClasses, SLORefusedError
from conveyor.server.app import build_app
from tests.helpers.load import counter
from tests.helpers.server import make_engine, running_server

pytestmark = pytest.mark.slow
CLASSES = ServiceClasses([
    ServiceClass.parse("interactive:ttft=0.001,demote=flex"),  # 1 us: nothing meets it once steps are measured
    ServiceClass.parse("flex:priority=10"),
    ServiceClass.parse("loose:ttft=600000,tpot=600000"),
])


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    app = build_app(make_engine(tiny_chat_dir), "tiny", None, log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                    service_classes=CLASSES)
    with running_server(app) as url:
        yield url


def chat(c: openai.OpenAI, tier: str | None = None, **kw):
    extra = {"service_tier": tier} if tier is not None else {}
    return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1 w2"}], max_tokens=4,
                                     extra_body=extra, **kw)


def test_refused_at_once_demoted_when_allowed_and_counted_per_class(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    for _ in range(2):  # the engine's steps are measured: the prediction exists from now on
        chat(c, "loose")
    with pytest.raises(openai.RateLimitError) as caught:
        chat(c)
    error = caught.value
    assert error.body["code"] == "slo_unattainable" and error.body["param"] == "service_tier"
    assert "interactive" in error.body["message"] and "TTFT" in error.body["message"]
    assert int(error.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):  # streamed: refused before the stream starts
        chat(c, stream=True)
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="tiny", prompt="w1 w2", max_tokens=3)
    assert chat(c, "auto").choices[0].finish_reason in ("stop", "length")  # demoted to flex
    with pytest.raises(openai.BadRequestError) as caught:
        chat(c, "gold")
    assert caught.value.body["param"] == "service_tier"
    messages = anthropic.Anthropic(base_url=server, api_key="x", max_retries=0)
    with pytest.raises(anthropic.RateLimitError):
        messages.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "w1"}],
                                 extra_body={"service_tier": "standard_only"})
    assert counter(server, "conveyor:slo_requests_total", service_class="interactive", decision="refused") == 4
    assert counter(server, "conveyor:slo_requests_total", service_class="interactive", decision="demoted") == 1
    assert counter(server, "conveyor:slo_requests_total", service_class="flex", decision="admitted") == 1
    assert counter(server, "conveyor:slo_finished_requests_total", service_class="loose", slo="met") == 2
    text = httpx.get(server + "/metrics").text
    assert 'conveyor:slo_ttft_prediction_abs_error_seconds{quantile="0.9"}' in text
    # the server's own time to each decision, as `bench mixed` reads it
    assert counter(server, "conveyor:slo_admission_decision_seconds_count", decision="admitted") == 3
    samples = asyncio.run(_scrape(server))
    refusals = server_refusal_time({}, samples)
    assert refusals["server_refused"] == 4 and 0 <= refusals["server_refused_within_50ms"] <= 4
    assert 0 < refusals["server_refusal_s_p50_at_most"] <= refusals["server_refusal_s_p99_at_most"]


async def _scrape(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url) as client:
        return await scrape(client)


def test_a_waiting_request_that_can_no_longer_meet_its_target_is_refused(tiny_chat_dir):
    step = OnlineStepTime()
    for tokens in (1, 8, 64):
        step.observe(tokens, 0.01 + 0.001 * tokens, False)
    classes = ServiceClasses([ServiceClass.parse("interactive:ttft=500")])
    controller = AdmissionController(classes, EngineShape(64, 8), CollectorRegistry(), step)

    async def admit():
        return controller.admit("r", [20], 10, 0, None)

    admitted = asyncio.run(admit())
    assert admitted.prediction.ttft_s < 0.5 and not controller.overdue(time.monotonic())
    (request_id, error), = controller.overdue(time.monotonic() + 1.0)  # it has waited a second: past 500 ms
    assert request_id == "r-0" and isinstance(error, SLORefusedError) and error.status == 429
    assert "after waiting" in error.message and not controller.overdue(time.monotonic() + 2.0)


def test_the_prediction_is_scaled_by_what_this_server_measured():
    from conveyor.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    step = OnlineStepTime()
    for tokens in (1, 8, 64):
        step.observe(tokens, 0.01 + 0.001 * tokens, False)
    registry = CollectorRegistry()
    controller = AdmissionController(ServiceClasses([ServiceClass.parse("interactive:ttft=60000")]),
                                     EngineShape(64, 8), registry, step)

    async def admit(rid: str):
        return controller.admit(rid, [20], 2, 0, None)

    first = None
    for i in range(20):  # every request took three times the model's TTFT, and twice its TPOT
        prediction = asyncio.run(admit(f"r{i}")).prediction
        first = first or prediction
        assert prediction == first, "until 20 finished, the model's own"
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=3 * first.ttft_s, finished_time=3 * first.ttft_s)
        controller.on_output(RequestOutput(f"r{i}-0", None, [1] * 20, [CompletionOutput(
            0, "x", [5, 6], "length", token_times=[0.1, 0.1 + 2 * first.tpot_s])], metrics, finished=True))
    later = asyncio.run(admit("later")).prediction
    assert later.ttft_s == pytest.approx(3 * first.ttft_s, rel=0.01)
    assert later.tpot_s == pytest.approx(2 * first.tpot_s, rel=0.01)
    # the errors, predicted (as admission used it) against measured
    assert controller.tpot_prediction_errors() == [(first.tpot_s, pytest.approx(2 * first.tpot_s))] * 20
    assert registry.get_sample_value("conveyor:slo_tpot_prediction_ratio", {"quantile": "0.5"}) == pytest.approx(2)
    assert registry.get_sample_value("conveyor:slo_ttft_prediction_ratio", {"quantile": "0.9"}) == pytest.approx(3)
