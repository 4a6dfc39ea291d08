"""The OpenAI-compatible server, over real HTTP (uvicorn on 127.0.0.1) with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor import LLM, SamplingParams
from tests.helpers.server import TEST_DTYPE, serve_model, wait_for

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

PROMPT = "w10 w11 w12 w13 w14"
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tiny_chat_dir):
    return tiny_chat_dir


@pytest.fixture(scope="module")
def server(model_dir):
    with serve_model(model_dir) as (url, app):
        yield SimpleNamespace(url=url, app=app, engine=app.state.async_engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name when present)."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# ---- the happy paths ------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_greedy_completion_equals_llm_generate(server, client, model_dir):
    llm = LLM(str(model_dir), dtype=TEST_DTYPE, num_kv_blocks=64)
    ref = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    ref = ref[0].outputs[0]
    resp = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 12 and resp.usage.total_tokens == 17
    # The same prompt as token ids gives the same completion.
    ids = llm.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == ref.text


def test_streaming_completion_matches_non_streaming(server, client):
    full = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # The wire format ends with the SSE terminator.
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    raw = httpx.post(server.url + "/v1/completions", json=body).text
    assert raw.rstrip().endswith("data: [DONE]") and raw.startswith("data: {")


def test_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w21 w22"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                          max_completion_tokens=7, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 7 and resp.usage.prompt_tokens == 6  # "system w20 user w21 w22 w5"
    stream = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0, max_tokens=7,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.total_tokens == 13


def test_n_seed_and_usage(client):
    kw = dict(model="tiny", prompt=PROMPT, n=3, temperature=1.0, max_tokens=6, seed=123,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # each completion has its own derived seed
    assert a.usage.completion_tokens == 18 and a.usage.prompt_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3"}], n=2,
                                          max_tokens=4, seed=5, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 8


def test_stop_string_streaming_and_not(client):
    text = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY).choices[0].text
    words = text.split()
    stop = words[3]
    expected = text[: text.index(stop)]  # the engine cuts at the first occurrence, even mid-word
    resp = client.completions.create(model="tiny", prompt=PROMPT, stop=[stop], **GREEDY)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected  # nothing of the stop string leaked out


def test_logprobs(client):
    resp = client.completions.create(model="tiny", prompt=PROMPT, logprobs=3, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert all(len(top) >= 3 for top in lp.top_logprobs) and all(v <= 0.0 for v in lp.token_logprobs)
    assert "".join(" " + t for t in lp.tokens) == resp.choices[0].text  # word tokens join with spaces
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w9"}],
                                          logprobs=True, top_logprobs=2, max_tokens=5)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the sampled token is the best of the top list.
    greedy = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w9"}],
                                            logprobs=True, top_logprobs=1, max_tokens=3, temperature=0.0)
    for c in greedy.choices[0].logprobs.content:
        assert c.token == c.top_logprobs[0].token


def test_batch_of_prompts(client):
    resp = client.completions.create(model="tiny", prompt=["w30 w31", "w40 w41 w42"], n=2, max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 2 * 1 + 3 * 1 and resp.usage.completion_tokens == 12


def test_tokenize_detokenize(server):
    tok = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "w7 w8"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "w7 w8"
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "w7"}]}).json()
    assert chat["count"] == 3  # "user w7 w5"


# ---- concurrency ----------------------------------------------------------------------------------------
def test_50_concurrent_streams_batch_and_match(server, client):
    prompts = [" ".join(f"w{4 + (7 * i + j) % 300}" for j in range(3 + i % 5)) for i in range(10)]
    expected = [client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text for p in prompts]
    batch_sizes = []
    listener = lambda record: batch_sizes.append(record.num_reqs)  # noqa: E731 - runs on the engine thread
    server.engine.step_listeners.append(listener)

    async def one(aclient, i: int) -> str:
        stream = await aclient.completions.create(model="tiny", prompt=prompts[i % 10], stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(50)))

    try:
        texts = asyncio.run(run_all())
    finally:
        server.engine.step_listeners.remove(listener)
    assert texts == [expected[i % 10] for i in range(50)]
    assert max(batch_sizes) > 1, "requests never shared a step"


# ---- errors ---------------------------------------------------------------------------------------------
LONG = " ".join(["w9"] * 600)
BAD = [
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),  # longer than the context (512)
    ("/v1/completions", {"prompt": "w1 w2", "max_tokens": 511}, 400, "prompt"),  # prompt + max_tokens > context
    ("/v1/completions", {"prompt": "w1", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w1", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "w1", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),  # missing prompt
    ("/v1/completions", {"prompt": "w1", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "prompt"),
    ("/v1/nothing", {"prompt": "w1"}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error_then_server_still_serves(server, client, path, body, status, param):
    resp = httpx.post(server.url + path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert client.completions.create(model="tiny", prompt="w1", max_tokens=2).choices[0].text


def test_invalid_json_and_openai_client_exceptions(server, client):
    resp = httpx.post(server.url + "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="w1", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w1")


# ---- disconnects free blocks ----------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server):
    before = metrics(server.url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # the request is running
    # The connection is closed: the engine aborts the request and frees its blocks within a step.
    idle = lambda m: m["conveyor:kv_cache_usage_perc"] == 0.0 and m["conveyor:num_requests_running"] == 0  # noqa
    assert wait_for(lambda: idle(metrics(server.url)))
    after = metrics(server.url)
    key = "conveyor:request_success_total{finished_reason=abort}"
    assert after[key] == before.get(key, 0.0) + 1


def test_disconnect_while_waiting_for_non_streaming_answer(server, caplog):
    caplog.set_level(logging.INFO, logger="conveyor.server")
    before = metrics(server.url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.1))
    key = "conveyor:request_success_total{finished_reason=abort}"
    assert wait_for(lambda: metrics(server.url).get(key, 0.0) == before.get(key, 0.0) + 1)
    assert metrics(server.url)["conveyor:kv_cache_usage_perc"] == 0.0
    # One quiet line, and no asyncio "exception was never retrieved" traceback when the futures are collected.
    assert wait_for(lambda: any("client disconnected" in r.getMessage() for r in caplog.records))
    gc.collect()
    quiet = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert len(quiet) == 1 and quiet[0].levelname == "INFO" and quiet[0].exc_info is None
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


# ---- metrics --------------------------------------------------------------------------------------------
def test_metrics_parse_and_move(server, client):
    before = metrics(server.url)
    client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    after = metrics(server.url)
    assert after["conveyor:prompt_tokens_total"] == before["conveyor:prompt_tokens_total"] + 5
    assert after["conveyor:generation_tokens_total"] == before["conveyor:generation_tokens_total"] + 12
    length = "conveyor:request_success_total{finished_reason=length}"
    assert after[length] == before.get(length, 0.0) + 1  # no label before the first such request (run alone)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert after[f"conveyor:{name}_count"] == before[f"conveyor:{name}_count"] + 1
    assert after["conveyor:inter_token_latency_seconds_count"] == before["conveyor:inter_token_latency_seconds_count"] + 11
    assert after["conveyor:iteration_tokens_total_count"] > before["conveyor:iteration_tokens_total_count"]
    assert after["conveyor:prefix_cache_queries_total"] > before["conveyor:prefix_cache_queries_total"]
    for name in ("num_preemptions_total", "prefix_cache_hits_total", "num_requests_waiting"):
        assert f"conveyor:{name}" in after
    assert json.dumps(after)  # plain numbers only


def test_metrics_count_what_the_prefix_cache_saved(server, client):
    # The same long prompt twice: the second finds the first's full blocks cached and skips them.
    prompt = " ".join(f"w{i}" for i in range(20, 60))
    client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    before = metrics(server.url)
    client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    after = metrics(server.url)

    def delta(name):
        return after.get(f"conveyor:{name}", 0.0) - before.get(f"conveyor:{name}", 0.0)

    saved = delta("prefix_cache_saved_tokens_total")
    block_size = server.engine.info.args.block_size
    assert saved >= block_size and saved % block_size == 0
    assert saved == delta("prefix_cache_hits_total")  # no cache pressure: every hit found was taken
    per_token, per_key = server.engine.info.prefix_hit_flops
    assert per_token > 0 and per_key > 0
    assert delta("prefix_cache_saved_flops_total") == pytest.approx(per_token * saved + per_key * saved * (saved + 1) / 2)
    assert delta("prefix_cache_saved_seconds_total") > 0


# ---- a bounded queue and an API key: a second, small server -----------------------------------------------
@pytest.fixture(scope="module")
def guarded(model_dir):
    with serve_model(model_dir, api_key="sekret", max_num_seqs=1, max_num_queued_reqs=2) as (url, app):
        yield SimpleNamespace(url=url, app=app)


def test_api_key_required_except_health_and_metrics(guarded):
    routes = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "w1", "max_tokens": 1}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}], "max_tokens": 1}),
              ("POST", "/tokenize", {"prompt": "w1"}), ("POST", "/detokenize", {"tokens": [5]})]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = httpx.request(method, guarded.url + path, json=body, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", path
        ok = httpx.request(method, guarded.url + path, json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200, (path, ok.text)
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_full_queue_answers_503_and_loses_nothing_admitted(guarded):
    async def one(aclient: httpx.AsyncClient):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}
        return await aclient.post("/v1/completions", json=body)

    async def run_all():
        headers = {"Authorization": "Bearer sekret"}
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient) for _ in range(12)))

    responses = asyncio.run(run_all())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["usage"]["completion_tokens"] == 100


def test_a_request_that_can_never_be_admitted_is_400_not_503(guarded):
    """1 seat + a queue bound of 2: at most 3 sequences can ever be in at once."""
    headers = {"Authorization": "Bearer sekret"}
    for body in ({"prompt": "w1", "n": 4}, {"prompt": ["w1", "w2"], "n": 2}):
        resp = httpx.post(guarded.url + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
        assert "Retry-After" not in resp.headers
    chat = httpx.post(guarded.url + "/v1/chat/completions", headers=headers,
                      json={"messages": [{"role": "user", "content": "w1"}], "n": 4, "max_tokens": 2})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "n"
    ok = httpx.post(guarded.url + "/v1/completions", json={"prompt": "w1", "n": 3, "max_tokens": 2},
                    headers=headers)  # idle: the seat and the whole queue
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


@pytest.fixture(scope="module")
def roomy(model_dir):
    with serve_model(model_dir, max_num_seqs=256, max_num_queued_reqs=4) as (url, app):
        yield url


def test_queue_bound_does_not_shed_requests_that_find_a_free_seat(roomy):
    """100 requests at once on an idle engine with 256 seats: none waits, so a bound of 4 refuses none."""

    async def run_all():
        async with httpx.AsyncClient(base_url=roomy, timeout=120) as aclient:
            body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
            return await asyncio.gather(*(aclient.post("/v1/completions", json=body) for _ in range(100)))

    codes = [r.status_code for r in asyncio.run(run_all())]
    assert codes == [200] * 100
