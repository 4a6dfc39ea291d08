"""AsyncEngine: background stepping, streams, abort, graceful drain, a crashed engine (tiny model, no HTTP)."""

from __future__ import annotations

import asyncio

import pytest

from conveyor import SamplingParams
from conveyor.engine.async_engine import AsyncEngine, EngineDeadError, EngineShuttingDownError
from tests.helpers.server import make_engine

pytestmark = pytest.mark.slow  # a real model, engine or server: run by CI, skipped by -m "not slow"

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


def run(coro_fn, engine):
    async def main():
        ae = AsyncEngine(engine)
        ae.start()
        try:
            return await coro_fn(ae)
        finally:
            await ae.shutdown()

    return asyncio.run(main())


def test_stream_is_cumulative_and_ends_finished(engine):
    async def go(ae: AsyncEngine):
        seen = [out async for out in await ae.add_request("a", PROMPT, SHORT)]
        counts = [len(o.outputs[0].token_ids) for o in seen]
        assert counts == sorted(counts) and counts[-1] == 5
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "length"
        assert ae.num_in_flight == 0

    run(go, engine)


def test_abort_frees_blocks_before_the_next_step(engine):
    async def go(ae: AsyncEngine):
        stream = await ae.add_request("long", PROMPT, LONG)
        first = await stream.__anext__()
        assert not first.finished
        ae.abort("long")
        last = [out async for out in stream][-1]
        assert last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) < 400
        assert await ae.call(lambda e: e.kv_manager.usage()) == 0.0

    run(go, engine)


def test_stats_snapshot_is_published_by_the_engine_thread(engine):
    async def go(ae: AsyncEngine):
        assert (ae.stats.num_running, ae.stats.num_waiting) == (0, 0)
        stream = await ae.add_request("long", PROMPT, LONG)
        await stream.__anext__()
        await stream.__anext__()  # a second output: the snapshot after the first step is out by now
        during = ae.stats
        assert during.num_running == 1 and during.kv_cache_usage > 0
        ae.abort("long")
        [out async for out in stream]
        await ae.call(lambda e: None)  # a command after the abort: the snapshot after the abort is out
        assert ae.stats.num_running == 0 and ae.stats.kv_cache_usage == 0.0
        assert during.num_running == 1  # a snapshot never changes

    run(go, engine)


def test_drain_finishes_short_requests_and_aborts_long_ones(engine):
    async def go(ae: AsyncEngine):
        short = await ae.add_request("s", PROMPT, SHORT)
        long = await ae.add_request("l", PROMPT, LONG)
        await long.__anext__()
        await ae.drain(timeout_s=0.3)
        assert [o async for o in short][-1].outputs[0].finish_reason == "length"
        assert [o async for o in long][-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineShuttingDownError):
            await ae.add_request("late", PROMPT, SHORT)

    run(go, engine)


def test_bad_request_raises_and_leaves_nothing_behind(engine):
    async def go(ae: AsyncEngine):
        with pytest.raises(ValueError, match="prompt"):
            await ae.add_request("bad", {"prompt_token_ids": []}, SHORT)
        assert ae.num_in_flight == 0
        assert [o async for o in await ae.add_request("good", PROMPT, SHORT)][-1].finished

    run(go, engine)


def test_a_crashed_engine_fails_every_stream(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)

    def broken_step():
        raise RuntimeError("boom")

    engine.step = broken_step  # the one way to make a real engine crash on purpose

    async def go(ae: AsyncEngine):
        stream = await ae.add_request("x", PROMPT, SHORT)
        with pytest.raises(EngineDeadError):
            await stream.__anext__()
        assert not ae.is_running
        with pytest.raises(EngineDeadError):
            await ae.add_request("y", PROMPT, SHORT)

    run(go, engine)


def test_a_batching_policy_that_waits_still_finishes(tiny_llama_dir):
    """The dynamic policy holds a lone request for max_wait_ms: steps schedule nothing until then."""
    engine = make_engine(tiny_llama_dir, policy="dynamic", max_num_seqs=4, max_wait_ms=50.0)

    async def go(ae: AsyncEngine):
        outs = [o async for o in await ae.add_request("d", PROMPT, SHORT)]
        assert outs[-1].outputs[0].finish_reason == "length"

    run(go, engine)
