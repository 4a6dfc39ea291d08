"""Scale-out on a local Ray (loopback only): 2 replicas behind conveyor's OpenAI app, the prefix router's
decisions on real traffic, and a replica killed mid-load. Needs the ``ray`` extra (skipped without it)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conveyor import LLM, SamplingParams
from tests.helpers.server import TEST_DTYPE, running_server

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'conveyor[ray]')")
from ray import serve  # noqa: E402

from conveyor.distributed.launch import APP_NAME, DEPLOYMENT_NAME, deploy, start_ray, stop_ray  # noqa: E402
from conveyor.distributed.metrics import PoolMetrics  # noqa: E402
from conveyor.engine.args import EngineArgs  # noqa: E402
from conveyor.server.app import build_app  # noqa: E402
from tests.helpers.ray_cluster import HANG_GUARD_S, health, join, ray_head, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

IMBALANCE = 3
SHARED = list(range(10, 74))  # 64 tokens: four full blocks of 16
TIMEOUT_S = 60.0
@pytest.fixture(scope="module")
def cluster(tiny_chat_dir):
    """Two replicas on a cluster joined with ``--ray-address`` (what ``conveyor serve --ray-address`` does),
    behind the app on a real server; on the way out, leaving the cluster must delete only conveyor's app."""
    args = EngineArgs(model=str(tiny_chat_dir), dtype=TEST_DTYPE, num_kv_blocks=256, block_size=16)
    with ray_head(num_cpus=2) as address:
        join(address)
        try:
            pool = deploy(args, "tiny", num_replicas=2, router="prefix",
                          router_kwargs={"imbalance_threshold": IMBALANCE, "seed": 0})
            app = build_app(pool, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                            metrics=PoolMetrics(pool), health_detail=pool.health)
            with running_server(app) as url:
                wait_for(lambda: len(health(url)["replicas"]) == 2, "2 replicas reporting")
                yield SimpleNamespace(url=url, pool=pool, args=args, sent=0)  # sent: requests served so far
        finally:
            stop_ray(joined=True)
        start_ray(address, num_cpus=0)  # the cluster lives on, without the app
        try:
            assert APP_NAME not in serve.status().applications
            assert ray.cluster_resources().get("CPU") == 2
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)


def served_per_replica(url: str) -> dict[str, float]:
    """Finished requests per replica, from the ingress's /metrics (the per-replica series)."""
    counts: dict[str, float] = defaultdict(float)
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "conveyor:request_success":
            for s in family.samples:
                if s.name.endswith("_total") and "replica" in s.labels:
                    counts[s.labels["replica"]] += s.value
    return dict(counts)


def counts_at(url: str, total: int) -> dict[str, float]:
    """Finished requests per replica, once the replicas' reports (posted every second) account for all
    ``total`` requests this module has sent."""
    wait_for(lambda: sum(served_per_replica(url).values()) >= total, f"{total} finished requests reported", 30)
    counts = served_per_replica(url)
    assert sum(counts.values()) == total, counts  # more would mean a request was served twice
    return counts


def served_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {r: v - before.get(r, 0.0) for r, v in after.items() if v - before.get(r, 0.0)}


def test_two_replicas_serve_the_openai_api(cluster, client, tiny_chat_dir):
    prompt = "w10 w11 w12 w13 w14"
    expected = LLM(str(tiny_chat_dir), dtype=TEST_DTYPE).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    greedy = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
    for _ in range(4):  # whichever replica answers, it is the same engine's answer
        resp = client.completions.create(model="tiny", prompt=prompt, **greedy)
        assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny", prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **greedy))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w7 w8"}],
                                          stream=True, max_tokens=5, extra_body={"ignore_eos": True})
    pieces = list(chat)
    assert pieces[-1].choices[0].finish_reason == "length"
    cluster.sent += 6
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the ingress validates, as one server does
        client.completions.create(model="tiny", prompt=prompt, max_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=prompt, max_tokens=1)


def test_metrics_per_replica_and_summed_and_health(cluster, client):
    counts_at(cluster.url, cluster.sent)  # earlier tests' requests all counted before this one's
    for i in range(6):  # distinct short prompts: no shared block, so power of two spreads them
        client.completions.create(model="tiny", prompt=f"w{20 + i} w{30 + i}", max_tokens=2)
    cluster.sent += 6
    counts_at(cluster.url, cluster.sent)
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    per_replica, summed = {}, None
    for family in text_string_to_metric_families(text):
        if family.name == "conveyor:prompt_tokens":
            for s in family.samples:
                if s.name.endswith("_total"):
                    if "replica" in s.labels:
                        per_replica[s.labels["replica"]] = s.value
                    else:
                        summed = s.value
    assert len(per_replica) == 2 and summed == sum(per_replica.values()) > 0
    body = health(cluster.url)
    assert sorted(r["id"] for r in body["replicas"]) == sorted(per_replica)
    assert body["deployment"]["replica_states"] == {"RUNNING": 2}


def test_prefix_router_keeps_a_shared_prefix_on_one_replica_while_balanced(cluster, client):
    before = counts_at(cluster.url, cluster.sent)
    for i in range(6):  # one at a time: queues stay balanced (both empty)
        client.completions.create(model="tiny", prompt=SHARED + [100 + i, 101 + i], max_tokens=2)
    cluster.sent += 6
    served = served_between(before, counts_at(cluster.url, cluster.sent))
    assert list(served.values()) == [6], served  # all six on one replica


def test_prefix_router_spreads_when_one_queue_runs_ahead(cluster):
    before = counts_at(cluster.url, cluster.sent)
    prefix = list(range(200, 264))

    async def load(n: int) -> list[str]:
        # One stream at a time, each opened once the previous one has streamed a token (its replica accepted it
        # and reported its queue to the router): a burst sent all at once would be routed on the queue lengths
        # of before the burst (with both cores busy, every one of twelve went to the prefix holder).
        async with openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0,
                                      timeout=TIMEOUT_S) as aclient:
            async def finish(stream) -> str | None:
                reason = None
                async for chunk in stream:
                    reason = chunk.choices[0].finish_reason or reason
                return reason

            tasks = []
            for i in range(n):
                stream = await aclient.completions.create(model="tiny", prompt=prefix + [300 + i], max_tokens=300,
                                                          stream=True, extra_body={"ignore_eos": True})
                first = await stream.__anext__()
                tasks.append(asyncio.ensure_future(finish(stream)))
                assert first.choices[0].finish_reason is None
            return await asyncio.gather(*tasks)

    assert asyncio.run(load(12)) == ["length"] * 12
    cluster.sent += 12
    served = served_between(before, counts_at(cluster.url, cluster.sent))
    # All twelve share a prefix, so while balanced they would all go to its holder (the test above); its queue ran
    # more than the threshold ahead, and the rest went elsewhere. (How many each got depends on timing.)
    assert len(served) == 2, served


def test_killing_a_replica_mid_load_loses_no_request_and_the_deployment_recovers(cluster):
    url = cluster.url
    n = 8
    progress = [0] * n

    async def one(aclient, i: int):
        try:
            stream = await aclient.completions.create(model="tiny", prompt=f"w{40 + i} w{50 + i} w{60 + i}",
                                                      max_tokens=480, stream=True, extra_body={"ignore_eos": True})
            reason = None
            async for chunk in stream:
                progress[i] += 1
                reason = chunk.choices[0].finish_reason or reason
            return ("ok", reason)
        except openai.APIError as exc:
            return ("error", str(exc))

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                      timeout=TIMEOUT_S) as aclient:
            tasks = [asyncio.ensure_future(one(aclient, i)) for i in range(n)]
            while not all(progress):  # every request has streamed: a replica lost now cannot be retried
                await asyncio.sleep(0.01)
            busy = max(cluster.pool.reports, key=lambda r: r.stats.num_running)
            victim = busy.replica_id
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim}", namespace="serve"),
                     no_restart=True)
            # A hang guard, not a speed bound: with both cores busy the survivors took over 60 s to finish.
            return victim, await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S)

    victim, results = asyncio.run(run())
    assert len(results) == n  # none hung
    errors = [r for r in results if r[0] == "error"]
    assert all(r == ("ok", "length") for r in results if r[0] == "ok"), results
    assert errors, "the killed replica was serving requests: they must end with an error, not silently"
    assert all("died" in e[1] or "replica" in e[1] for e in errors), errors

    # New requests go to the live replica at once, and Ray brings the deployment back to 2.
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
    for i in range(3):
        assert client.completions.create(model="tiny", prompt=f"w{70 + i}", max_tokens=3).usage.completion_tokens == 3
    wait_for(lambda: serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states
             == {"RUNNING": 2}, "Ray Serve to replace the killed replica")
    wait_for(lambda: len(health(url)["replicas"]) == 2 and victim not in {r["id"] for r in health(url)["replicas"]},
             "the new replica to report and the dead one to age out")
    for i in range(4):
        assert client.completions.create(model="tiny", prompt=f"w{80 + i}", max_tokens=3).usage.completion_tokens == 3


def test_round_robin_router_alternates_whatever_the_prefix(cluster):
    """Last in the module: it redeploys the app with ``--router round-robin`` (the replicas restart)."""
    pool = deploy(cluster.args, "tiny", num_replicas=2, router="round-robin")
    app = build_app(pool, "tiny", log_stats_interval_s=0.0, shutdown_timeout_s=2.0,
                    metrics=PoolMetrics(pool), health_detail=pool.health)
    with running_server(app) as url:
        wait_for(lambda: serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states
                 == {"RUNNING": 2}, "Ray Serve to run both redeployed replicas")
        wait_for(lambda: len(health(url)["replicas"]) == 2, "the redeployed replicas reporting")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
        for _ in range(6):  # one prompt, one at a time: the prefix router would keep all six on one replica
            resp = client.completions.create(model="tiny", prompt=SHARED + [7], max_tokens=2)
            assert resp.usage.completion_tokens == 2
        assert sorted(counts_at(url, 6).values()) == [3, 3]
