"""Models on demand (issue 53): one API process serving a directory of models, each loaded in an engine process of
its own when a request first names it and unloaded when idle or when ``--max-loaded-models`` needs room.

A real uvicorn server on 127.0.0.1 with real engine processes: tiny Llamas (three seeds) and a corrupt GGUF file in
one directory. Its engines' steps last at least 10 ms (``faults.engine_core_with_faults``), so a long stream is
still in flight while other models load. The last test runs ``conveyor serve --model NAME=PATH`` itself, to watch
an idle model's engine process end and the process tree's memory go back."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.engine.args import EngineArgs
from conveyor.engine.core_client import EngineCoreClient
from conveyor.server.limits import max_token_chars
from conveyor.server.model_catalog import ModelCatalog
from conveyor.server.model_memory import MemoryBudget
from conveyor.server.model_pool import ModelPool
from conveyor.server.router_app import build_router_app
from conveyor.server.serving_common import ServingContext
from tests.helpers.checkpoints import TINY_VOCAB, save_tiny_llama, write_word_tokenizer
from tests.helpers.faults import engine_core_with_faults
from tests.helpers.load import start_command
from tests.helpers.server import CHAT_TEMPLATE, running_server, wait_for

pytestmark = pytest.mark.slow
MODELS = ("alpha", "beta", "gamma")
LOAD_S = 120.0  # a bound, not a speed: a tiny model's engine process starts in ~3 s on an idle machine


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(MODELS):
        write_word_tokenizer(save_tiny_llama(root / name, seed=seed), TINY_VOCAB, chat_template=CHAT_TEMPLATE)
    (root / "broken.gguf").write_bytes(b"GGUF" + bytes(60))  # a GGUF magic with nothing valid behind it
    return root


@pytest.fixture(scope="module")
def served(models_dir):
    """``--models-dir`` with ``--max-loaded-models 2`` and models kept loaded until room is needed."""
    args = EngineArgs(dtype="float32", num_kv_blocks=256, block_size=16)

    def start_engine(name: str, path: str) -> EngineCoreClient:
        return EngineCoreClient(dataclasses.replace(args, model=path), entry=engine_core_with_faults).wait_ready()

    def make_context(engine, name: str) -> ServingContext:
        return ServingContext(engine, name, max_token_chars=max_token_chars(engine.info.tokenizer))

    pool = ModelPool(ModelCatalog(models_dir=str(models_dir)), start_engine, make_context, keep_alive_s=-1,
                     max_loaded=2, load_timeout_s=LOAD_S)
    with running_server(build_router_app(pool, shutdown_timeout_s=5.0)) as url:
        yield url, pool
    assert not pool.loaded


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=LOAD_S)


def chat(client: openai.OpenAI, model: str, max_tokens: int = 6) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w1 w2 w3"}],
                                           max_tokens=max_tokens, temperature=0)
    assert reply.model == model and reply.choices[0].finish_reason == "length"
    return reply.choices[0].message.content


def states(url: str) -> dict[str, str]:
    return httpx.get(url + "/health", timeout=10).json()["models"]


def test_two_models_behind_one_server(served):
    url, pool = served
    client = sdk(url)
    listed = {m.id: m.model_extra["status"]["value"] for m in client.models.list()}
    assert set(listed) == {*MODELS, "broken"}
    answers = {name: chat(client, name) for name in ("alpha", "beta")}
    assert answers["alpha"] != answers["beta"]  # two different models answered
    assert chat(client, "alpha") == answers["alpha"]  # each as itself, greedy, every time
    assert states(url)["alpha"] == states(url)["beta"] == "loaded"
    assert {m.id: m.model_extra["status"]["value"] for m in client.models.list()}["beta"] == "loaded"
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'conveyor:model_loaded{model_name="alpha"} 1.0' in metrics
    assert 'conveyor:model_loaded{model_name="broken"} 0.0' in metrics
    pids = {name: pool.loaded[name].engine.info.pid for name in ("alpha", "beta")}
    assert len(set(pids.values())) == 2 and all(psutil.pid_exists(p) for p in pids.values())


def test_unknown_model_is_404_in_each_protocol(served):
    url, pool = served
    with pytest.raises(openai.NotFoundError) as err:
        chat(sdk(url), "nope")
    assert err.value.body["code"] == "model_not_found"
    assert httpx.get(url + "/v1/models/nope", timeout=10).status_code == 404
    with pytest.raises(anthropic.NotFoundError) as err:
        anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "w1"}])
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=url, timeout=30).chat(model="nope", messages=[{"role": "user", "content": "w1"}])
    assert err.value.status_code == 404 and "nope" in err.value.error
    assert "nope" not in pool.counts["load_failures"]


def test_corrupt_model_fails_its_requests_and_the_others_serve(served):
    url, pool = served
    client = sdk(url)

    def broken(_):
        with pytest.raises(openai.InternalServerError) as err:
            chat(client, "broken")
        return err.value.body

    with ThreadPoolExecutor(6) as workers:  # the broken model's requests and alpha's, at once
        failed = list(workers.map(broken, range(3)))
        answered = list(workers.map(lambda _: chat(client, "alpha"), range(3)))
    for body in failed:
        assert body["code"] == "model_load_failed" and "could not be loaded" in body["message"]
        assert "GGUF" in body["message"]  # the reason, from the loader
    assert len(set(answered)) == 1
    reply = httpx.post(url + "/api/generate", json={"model": "broken", "prompt": "w1", "stream": False}, timeout=LOAD_S)
    assert reply.status_code == 500 and "could not be loaded" in reply.json()["error"]  # Ollama's shape
    assert states(url)["broken"] == "failed"
    chat(client, "beta")


def test_a_burst_for_a_model_still_loading_all_completes(served):
    url, pool = served
    client = sdk(url)
    if states(url)["gamma"] == "loaded":  # (from an earlier run of this test alone): make room for it again
        chat(client, "alpha"), chat(client, "beta")
    loads = pool.counts["loads"].get("gamma", 0)
    with ThreadPoolExecutor(16) as workers:
        first = workers.submit(chat, client, "gamma")
        assert wait_for(lambda: states(url)["gamma"] != "unloaded", LOAD_S)
        assert first.done() or states(url)["gamma"] == "loading"  # the rest arrive while it loads (or after)
        answers = [first.result(), *workers.map(lambda _: chat(client, "gamma"), range(15))]
    assert len(answers) == 16 and len(set(answers)) == 1
    assert pool.counts["loads"]["gamma"] == loads + 1  # one load served the burst


def test_lru_eviction_never_unloads_a_model_in_use(served):
    url, pool = served
    client = sdk(url)
    # A stream on alpha that the client does not read: ~2 MB of chunks fill the socket buffers, so its response
    # (and so its use of alpha) lasts until the client reads it, whatever the machine's speed.
    body = {"model": "alpha", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 200, "n": 8,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=LOAD_S) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        alpha = pool.loaded["alpha"]
        unloads = dict(pool.counts["unloads"])
        chat(client, "beta")  # loaded = {alpha, beta}: if gamma was loaded, it went (alpha is in use)
        assert alpha.busy and set(pool.loaded) == {"alpha", "beta"}
        beta_pid = pool.loaded["beta"].engine.info.pid
        chat(client, "gamma")  # needs room: beta is idle, alpha is not
        assert set(pool.loaded) == {"alpha", "gamma"} and pool.loaded["alpha"] is alpha
        assert pool.counts["unloads"].get(("beta", "room"), 0) == unloads.get(("beta", "room"), 0) + 1
        assert wait_for(lambda: not psutil.pid_exists(beta_pid) or psutil.Process(beta_pid).status() == "zombie")
        finished, usage = set(), None
        for line in lines:  # now the stream, to its end
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    if choice["finish_reason"] is not None:
                        assert choice["finish_reason"] == "length"
                        finished.add(choice["index"])
    assert finished == set(range(8)) and usage["completion_tokens"] == 8 * 200
    alpha_unloads = {k: v for k, v in pool.counts["unloads"].items() if k[0] == "alpha"}
    assert alpha_unloads == {k: v for k, v in unloads.items() if k[0] == "alpha"}  # alpha was never unloaded


def test_memory_budget_unloads_idle_models_until_the_measured_ones_fit(models_dir):
    """``--max-loaded-memory``: a model is charged its engine process's measured resident memory; before its first
    load, its weight files' size. With room for one and a half engines, the second model fits by its estimate, is
    measured once loaded, and the first (idle) unloads to settle; loading the first again (now charged what it held)
    unloads the second before it starts; a budget below one engine still serves each model alone."""
    args = EngineArgs(dtype="float32", num_kv_blocks=64, block_size=16)

    def start_engine(name: str, path: str) -> EngineCoreClient:
        return EngineCoreClient(dataclasses.replace(args, model=path)).wait_ready()

    def make_context(engine, name: str) -> ServingContext:
        return ServingContext(engine, name, max_token_chars=max_token_chars(engine.info.tokenizer))

    budget = MemoryBudget(1 << 40)  # no bound until alpha's size is known
    pool = ModelPool(ModelCatalog(models_dir=str(models_dir)), start_engine, make_context, keep_alive_s=-1,
                     load_timeout_s=LOAD_S, memory=budget)
    with running_server(build_router_app(pool, shutdown_timeout_s=5.0)) as url:
        client = sdk(url)
        first = chat(client, "alpha")
        alpha_bytes = pool.loaded["alpha"].bytes
        assert alpha_bytes == budget.last_seen["alpha"] > 50 << 20  # an engine process: the runtime, the weights
        assert 0 < budget.expected("beta", str(models_dir / "beta")) < alpha_bytes // 2  # beta's files, tiny
        budget.limit_bytes = alpha_bytes * 3 // 2
        chat(client, "beta")  # fits by its estimate; measured, it does not: alpha (idle) makes room
        assert wait_for(lambda: set(pool.loaded) == {"beta"}, 60)  # (the settle runs beside beta's requests)
        assert set(pool.loaded) == {"beta"} and pool.counts["unloads"] == {("alpha", "room"): 1}
        assert chat(client, "alpha") == first  # charged what it held: beta unloads before alpha starts
        assert set(pool.loaded) == {"alpha"} and pool.counts["unloads"][("beta", "room")] == 1
        budget.limit_bytes = 1 << 20  # below any engine: each model still loads, alone
        chat(client, "gamma")
        assert set(pool.loaded) == {"gamma"} and pool.counts["unloads"][("alpha", "room")] == 2
    assert not pool.loaded


def engine_pids(served) -> set[int]:
    return {p.pid for p in served.descendants()
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())}


def loads(url: str) -> float:
    """Model loads so far, every model's (``conveyor:model_loads_total``)."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    return sum(s.value for f in families if f.name == "conveyor:model_loads" for s in f.samples
               if s.name.endswith("_total"))


def test_idle_model_unloads_and_its_memory_returns(models_dir, tmp_path):
    """``conveyor serve --model NAME=PATH --keep-alive 2 --max-loaded-models 1``; Ollama's keep_alive per request."""
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", f"alpha={models_dir / 'alpha'}",
           "--model", f"beta={models_dir / 'beta'}", "--keep-alive", "2", "--max-loaded-models", "1",
           "--max-loaded-memory", "64", "--dtype", "float32", "--num-kv-blocks", "64"]
    server = start_command(cmd, tmp_path / "serve.log")
    try:
        assert engine_pids(server) == set()  # nothing loads before a request names it
        idle_rss = server.rss_mb()
        reply = httpx.post(server.url + "/v1/completions", json={"model": "alpha", "prompt": "w1 w2", "max_tokens": 4},
                           timeout=LOAD_S)
        assert reply.status_code == 200, reply.text
        (engine,) = engine_pids(server)
        loaded_rss, engine_rss = server.rss_mb(), psutil.Process(engine).memory_info().rss / 2**20
        assert "at most 64 GiB loaded" in server.log() and re.search(r"model alpha loaded .* GiB resident",
                                                                     server.log()), server.log()[-2000:]
        assert wait_for(lambda: states(server.url)["alpha"] == "unloaded", 60), server.log()[-2000:]
        assert wait_for(lambda: engine_pids(server) == set(), 30)  # its engine process has ended
        unloaded_rss = server.rss_mb()
        assert unloaded_rss < loaded_rss - 0.8 * engine_rss, (idle_rss, loaded_rss, engine_rss, unloaded_rss)

        client = ollama.Client(host=server.url, timeout=LOAD_S)
        client.generate(model="BETA:latest", prompt="w1", keep_alive=-1, options={"num_predict": 2})
        time.sleep(3)  # past --keep-alive: beta stays, as its request asked
        (running,) = client.ps().models
        assert running.model == "beta:latest" and running.expires_at.year >= time.gmtime().tm_year + 5
        assert {m.model for m in client.list().models} == {"alpha:latest", "beta:latest"}
        assert client.generate(model="beta", prompt="", keep_alive=0).done_reason == "unload"
        assert wait_for(lambda: client.ps().models == [], 30)
        assert wait_for(lambda: engine_pids(server) == set(), 30)

        # --max-loaded-models 1: requests for both models at once all complete, each model loaded once for them
        # (one load more if a request came late), never taken back and forth while its requests wait.
        before = loads(server.url)

        def completion(name: str) -> httpx.Response:
            return httpx.post(server.url + "/v1/completions", json={"model": name, "prompt": "w1", "max_tokens": 3},
                              timeout=LOAD_S)

        with ThreadPoolExecutor(8) as workers:
            replies = list(workers.map(completion, ["alpha", "beta"] * 4))
        assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies]
        assert len(engine_pids(server)) <= 1
        assert 2 <= loads(server.url) - before <= 3
    finally:
        _, left = server.stop(timeout_s=30)
    assert not left, f"processes outlived conveyor serve: {left}"


def test_keep_alive_durations():
    from conveyor.server.errors import APIError
    from conveyor.server.ollama.protocol import keep_alive_seconds

    assert [keep_alive_seconds(v) for v in (None, 0, 30, "0", "5m", "1h30m", "-1", "-1m", "1.5s", "250ms")] == \
        [None, 0, 30, 0.0, 300.0, 5400.0, -1.0, -60.0, 1.5, 0.25]
    for bad in ("", "5 minutes", "m", "1d"):
        with pytest.raises(APIError):
            keep_alive_seconds(bad)


def test_catalog_names_models_by_file_and_directory(models_dir, tmp_path):
    from conveyor.server.model_catalog import ModelCatalog, split_named_model

    catalog = ModelCatalog([("mine", str(models_dir / "alpha"))], str(models_dir))
    assert catalog.names == ["mine", "alpha", "beta", "broken", "gamma"]
    assert catalog.path_of("broken") == str(models_dir / "broken.gguf")
    assert split_named_model(f"x={models_dir}") == ("x", str(models_dir))
    assert split_named_model(str(models_dir / "alpha")) is None and split_named_model("SmolLM2-135M") is None
    with pytest.raises(ValueError, match="no models"):
        ModelCatalog(models_dir=str(tmp_path))
