"""AsyncEngine: background stepping, streams, abort, graceful drain, a crashed engine (tiny model, no HTTP)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conveyor import SamplingParams
from conveyor.engine.async_engine import AsyncEngine, EngineDeadError, EngineShuttingDownError, RequestFailedError
from conveyor.engine.engine_client import ServedEngine
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


def test_it_is_a_served_engine_whose_facts_are_the_engines(engine):
    async def go(ae: AsyncEngine):
        assert isinstance(ae, ServedEngine)
        info = ae.info
        assert (info.tokenizer, info.model_info, info.max_model_len, info.max_seqs_per_request) == (
            engine.tokenizer, engine.model_info, engine.max_model_len, engine.max_seqs_per_request)
        assert ae.step_listeners is engine.step_listeners  # called on the engine thread, as the engine's own
        assert await ae.tokenizer_call(lambda i: i.encode("w1 w2")) == engine.encode("w1 w2")
        # A prepared prompt gets the facts, and its tokens are what the engine runs.
        seen = [out async for out in await ae.add_request("p", lambda i: {"prompt_token_ids": i.encode("w1")},
                                                          SHORT)]
        assert seen[-1].prompt_token_ids == engine.encode("w1")

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


def test_drain_finishes_short_requests_and_aborts_long_ones(tiny_llama_dir):
    """Deterministic whatever the machine's speed: once the short request has finished, the engine thread is
    held between steps until the drain gives up and aborts, so the long one cannot finish in the meantime."""
    engine = make_engine(tiny_llama_dir)
    short_done, aborting = threading.Event(), threading.Event()

    def on_output(out):  # engine thread
        if out.request_id == "s" and out.finished:
            short_done.set()

    def hold_after_short(record):  # engine thread, after each step
        if short_done.is_set():
            assert aborting.wait(30), "the drain never aborted"

    engine.step_listeners.append(hold_after_short)

    async def go(ae: AsyncEngine):
        ae.output_listeners.append(on_output)
        abort = ae.abort
        ae.abort = lambda request_id: (abort(request_id), aborting.set())  # release the engine once asked
        short = await ae.add_request("s", PROMPT, SHORT)
        long = await ae.add_request("l", PROMPT, LONG)
        assert [o async for o in short][-1].outputs[0].finish_reason == "length"
        await ae.drain(timeout_s=0.1)
        last = [o async for o in long][-1].outputs[0]
        assert last.finish_reason == "abort" and len(last.token_ids) < 400
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


def test_a_crashed_engine_fails_every_stream_and_every_queued_call(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    in_step, gate = threading.Event(), threading.Event()

    def broken_step():
        in_step.set()
        assert gate.wait(30)
        raise RuntimeError("boom")

    engine.step = broken_step  # the one way to make a real engine crash on purpose

    async def go(ae: AsyncEngine):
        deaths = []
        ae.on_dead.append(deaths.append)
        stream = await ae.add_request("x", PROMPT, SHORT)
        assert await asyncio.to_thread(in_step.wait, 30)
        queued = asyncio.ensure_future(ae.call(lambda e: e.kv_manager.usage()))  # waits behind the dying step
        await asyncio.sleep(0)  # the command is queued
        gate.set()
        with pytest.raises(EngineDeadError):
            await stream.__anext__()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(queued, 10)  # answered, not left hanging
        assert not ae.is_running
        with pytest.raises(EngineDeadError):
            await ae.add_request("y", PROMPT, SHORT)
        with pytest.raises(EngineDeadError):
            await ae.call(lambda e: None)
        assert [repr(d) for d in deaths] == [repr(RuntimeError("boom"))]

    run(go, engine)


def test_a_request_that_fails_in_the_engine_raises_in_its_own_stream_only(engine):
    bad = SamplingParams(seed=1, max_tokens=5)
    bad.seed = 2**70  # past validation: its generator cannot be seeded

    async def go(ae: AsyncEngine):
        failing = await ae.add_request("bad", PROMPT, bad)
        good = await ae.add_request("good", PROMPT, SHORT)
        with pytest.raises(RequestFailedError, match="sampling generator"):
            [o async for o in failing]
        assert [o async for o in good][-1].outputs[0].finish_reason == "length"
        assert ae.is_running and ae.num_in_flight == 0

    run(go, engine)


def test_a_batching_policy_that_waits_still_finishes(tiny_llama_dir):
    """The dynamic policy holds a lone request for max_wait_ms: steps schedule nothing until then."""
    engine = make_engine(tiny_llama_dir, policy="dynamic", max_num_seqs=4, max_wait_ms=50.0)

    async def go(ae: AsyncEngine):
        outs = [o async for o in await ae.add_request("d", PROMPT, SHORT)]
        assert outs[-1].outputs[0].finish_reason == "length"

    run(go, engine)


def test_fail_request_ends_the_stream_with_the_error_and_frees_the_request(engine):
    class Refused(Exception):
        pass

    async def go(ae: AsyncEngine):
        stream = await ae.add_request("f", PROMPT, LONG)
        first = await stream.__anext__()
        assert not first.finished
        ae.fail_request("f", Refused("no longer meets its target"))
        with pytest.raises(Refused):
            async for _ in stream:
                pass
        assert ae.num_in_flight == 0
        ae.fail_request("f", Refused("again"))  # a finished request: nothing happens
        for _ in range(200):
            if ae.stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert ae.stats.num_running == 0, "its blocks were freed"

    run(go, engine)
