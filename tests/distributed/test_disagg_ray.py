"""Disaggregated prefill / decode on a real Ray Serve (loopback only): 1 prefill + 1 decode replica behind
conveyor's OpenAI app, the KV handed over through Ray's object store. The hand-off changes no token; aborts
(some during the transfer) leave both replicas at 0 KV and 0 requests; a replica killed mid-transfer costs its
request a retry or an error, never a hang; and ``conveyor serve --disaggregate 1P1D`` serves the same API.
Needs the ``ray`` extra (skipped without it)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import httpx
import openai
import pytest

from conveyor import LLM, SamplingParams
from tests.helpers.server import TEST_DTYPE, running_server

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'conveyor[ray]')")

from conveyor.distributed.launch import (  # noqa: E402
    APP_NAME, DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, deploy_disaggregated, stop_ray,
)
from conveyor.distributed.metrics import PoolMetrics  # noqa: E402
from conveyor.engine.args import EngineArgs  # noqa: E402
from conveyor.server.app import build_app  # noqa: E402
from tests.helpers.ray_cluster import HANG_GUARD_S, HEAD_ENV, free_port, health, join, ray_head, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
SHARED = " ".join(f"w{i}" for i in range(10, 58))  # 48 words: three full blocks of 16 (the prefill cache's)
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cluster(tiny_chat_dir):
    args = EngineArgs(model=str(tiny_chat_dir), dtype=TEST_DTYPE, num_kv_blocks=128, block_size=16)
    with ray_head(num_cpus=2) as address:
        join(address)
        try:
            pool = deploy_disaggregated(args, "tiny", 1, 1, router="prefix", pin_cpus=True)  # a CPU each
            app = build_app(pool, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                            metrics=PoolMetrics(pool), health_detail=pool.health)
            with running_server(app) as url:
                wait_for(lambda: len(health(url)["replicas"]) == 2, "both replicas reporting")
                yield SimpleNamespace(url=url, pool=pool, args=args, address=address)
        finally:
            stop_ray(joined=True)
            ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def single(tiny_chat_dir):
    return LLM(str(tiny_chat_dir), dtype=TEST_DTYPE)


def expected_text(llm: LLM, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def replica_actor(role: str):
    """The live replica actor of a deployment (one each here)."""
    prefix = f"SERVE_REPLICA::{APP_NAME}#{role}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def set_fetch_delay(cluster, seconds: float) -> None:
    cluster.pool.handle.set_fetch_delay.remote(seconds).result(timeout_s=TIMEOUT_S)


def all_idle(cluster) -> bool:
    """Both replicas' latest reports: no request running or waiting, no KV block in use."""
    reports = cluster.pool.reports
    return len(reports) == 2 and all(r.stats.num_running == r.stats.num_waiting == 0 and
                                     r.stats.kv_cache_usage == 0.0 for r in reports)


def test_disaggregated_tokens_equal_a_single_engine(cluster, client, single):
    prompts = ["w10 w11 w12 w13 w14", "w200 w7 w9"] + [f"{SHARED} w{100 + i}" for i in range(3)]
    handed = cluster.pool.num_handed_over
    for p in prompts:
        resp = client.completions.create(model="tiny", prompt=p, max_tokens=12, **GREEDY)
        assert resp.choices[0].text == expected_text(single, p, 12) and resp.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(single, prompts[0], 12)
    assert chunks[-1].usage.completion_tokens == 12
    assert cluster.pool.num_handed_over - handed == len(prompts) + 1
    # n > 1 is served whole on the decode replica; max_tokens=1 ends on the prefill replica
    two = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=5, n=2, **GREEDY)
    assert [c.text for c in two.choices] == [expected_text(single, prompts[1], 5)] * 2
    one = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=1, **GREEDY)
    assert one.usage.completion_tokens == 1
    assert cluster.pool.num_handed_over - handed == len(prompts) + 1
    # the shared head was a prefix-cache hit on the prefill replica for the 2nd and 3rd of those prompts
    wait_for(lambda: prefix_hits(cluster.url) >= 2 * 48, "the prefill replica's report of its prefix hits", 30)


def prefix_hits(url: str) -> float:
    """Prompt tokens found in the prefix caches, summed over the replicas (the series without a replica label)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("conveyor:prefix_cache_hits_total{") and "replica=" not in line)


def test_aborts_some_during_the_transfer_leave_both_sides_empty(cluster):
    """40 streams, a fifth closed by the client: at random points, and some while the decode replica waits to
    fetch the KV (a fetch delay makes that window wide). Both replicas end with no request and no KV."""
    rng = random.Random(3)
    set_fetch_delay(cluster, 0.3)

    async def one(aclient, i: int):
        stream = await aclient.completions.create(model="tiny", prompt=f"{SHARED} w{200 + i % 7} w{i}",
                                                  max_tokens=40, stream=True, **GREEDY)
        cut = rng.randint(1, 10) if i % 5 == 0 else None
        n, reason = 0, None
        async for chunk in stream:
            n += 1
            reason = chunk.choices[0].finish_reason or reason
            if cut is not None and n >= cut:  # n == 1: the first token came from prefill, the KV is in transit
                await stream.close()
                return "aborted"
        return reason

    async def run():
        async with openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0,
                                      timeout=TIMEOUT_S) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(40))), HANG_GUARD_S)

    try:
        results = asyncio.run(run())
    finally:
        set_fetch_delay(cluster, 0.0)
    assert results.count("aborted") == 8 and results.count("length") == 32, results
    wait_for(lambda: all_idle(cluster), "both replicas to report 0 requests and 0 KV", 60)
    assert cluster.pool.num_in_flight == 0
    wait_for(lambda: cluster.pool.prefill_handle.num_held.remote().result(timeout_s=TIMEOUT_S) == 0,
             "the prefill replica to let go of every hand-off's KV", 30)


def stream_then(cluster, prompt: str, max_tokens: int, kill_role: str):
    """Start a stream, and once its first token (from prefill) arrived, kill the ``kill_role`` replica while
    the decode replica waits to fetch the KV. Returns ("ok", text) or ("error", message)."""
    async def run():
        async with openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0,
                                      timeout=TIMEOUT_S) as aclient:
            text = ""
            try:
                stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                          stream=True, **GREEDY)
                async for chunk in stream:
                    if not text and chunk.choices and chunk.choices[0].text:
                        ray.kill(replica_actor(kill_role), no_restart=True)
                    text += chunk.choices[0].text if chunk.choices else ""
                return ("ok", text)
            except openai.APIError as exc:
                return ("error", str(exc))

    return asyncio.run(asyncio.wait_for(run(), HANG_GUARD_S))


def back_to_two(cluster):
    wait_for(lambda: {d: s["replica_states"] for d, s in cluster.pool.deployment_status.items()}
             == {PREFILL_DEPLOYMENT: {"RUNNING": 1}, DECODE_DEPLOYMENT: {"RUNNING": 1}},
             "Ray Serve to replace the killed replica")
    wait_for(lambda: len(health(cluster.url)["replicas"]) == 2, "both replicas reporting again")


def test_prefill_replica_killed_mid_transfer_ends_its_request_with_an_error(cluster, client, single):
    set_fetch_delay(cluster, 3.0)
    try:
        kind, what = stream_then(cluster, "w31 w32 w33", 12, PREFILL_DEPLOYMENT)
    finally:
        set_fetch_delay(cluster, 0.0)
    # The KV lived in the killed replica's object store: the first token reached the client, the rest cannot
    # (an error, not a hang and not a silent truncation).
    assert kind == "error" and "lost in transfer" in what, what
    back_to_two(cluster)
    wait_for(lambda: all_idle(cluster), "both replicas to report 0 requests and 0 KV", 60)
    resp = client.completions.create(model="tiny", prompt="w31 w32 w33", max_tokens=6, **GREEDY)
    assert resp.choices[0].text == expected_text(single, "w31 w32 w33", 6)


def test_decode_replica_killed_mid_transfer_is_retried_with_the_same_kv(cluster, client, single):
    set_fetch_delay(cluster, 3.0)  # the replacement starts without the delay
    kind, what = stream_then(cluster, "w41 w42 w43", 12, DECODE_DEPLOYMENT)
    # Nothing past the first token had been streamed: the same KV reference goes to the new decode replica, and
    # the tokens are a single engine's. (On a machine so busy that the replacement takes longer than the accept
    # timeout the request ends with an error instead: bounded either way.)
    if kind == "ok":
        assert what == expected_text(single, "w41 w42 w43", 12)
    else:
        assert "decode" in what or "replica" in what, what
    back_to_two(cluster)
    wait_for(lambda: all_idle(cluster), "both replicas to report 0 requests and 0 KV", 60)
    assert client.completions.create(model="tiny", prompt="w44", max_tokens=3, **GREEDY).usage.completion_tokens == 3


def test_serve_cli_disaggregate_flag_serves_the_openai_api(cluster, tiny_chat_dir):
    """Last in the module: ``conveyor serve --disaggregate 1P1D`` joins the cluster and replaces the app."""
    port = free_port()
    cmd = [sys.executable, "-m", "conveyor", "serve", "--model", str(tiny_chat_dir), "--dtype", "float32",
           "--num-kv-blocks", "128", "--port", str(port), "--host", "127.0.0.1", "--disaggregate", "1P1D",
           "--ray-address", cluster.address, "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, env={**os.environ, **HEAD_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                return len(health(url)["replicas"]) == 2
            except httpx.HTTPError:
                return False

        wait_for(up, "the CLI's 1P1D deployment")
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
        resp = c.completions.create(model="tiny", prompt="w10 w11 w12", max_tokens=8, **GREEDY)
        # the CLI offers no float64: the oracle is the same model in float32
        assert resp.choices[0].text == expected_text(LLM(str(tiny_chat_dir), dtype="float32"), "w10 w11 w12", 8)
        assert set(health(url)["deployment"]) == {PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
