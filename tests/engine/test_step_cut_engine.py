"""Steps cut short by an arrival that outranks them (engine.step_cut), in a real engine on a tiny random Llama
written by transformers: cuts forced at chosen steps (the cutter's test hook offers a better priority once a step
is armed) change no greedy token of the batch requests, stop the forward in the per-layer path (prompt-sized
steps) and in the native layer stack (decode steps), keep the scheduler's invariants, and never let the prefix
cache serve a block the cut step was computing."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.policies import BATCH_PRIORITY
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from tests.helpers.checkpoints import TINY_VOCAB as VOCAB, save_tiny_llama

pytestmark = pytest.mark.slow  # a real model and engine
pytest.importorskip("transformers")

GEN = torch.Generator().manual_seed(3)
SHARED = torch.randint(8, VOCAB, (24,), generator=GEN).tolist()
PROMPTS = [SHARED + torch.randint(8, VOCAB, (40 + 17 * i,), generator=GEN).tolist() for i in range(6)]
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=192, max_num_batched_tokens=160,
              debug_invariants=True, scheduling_policy="priority")


def greedy(max_tokens: int, priority: int = BATCH_PRIORITY) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, priority=priority)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_llama(path, num_hidden_layers=4)
    return str(path)


def findable_beyond_computed(engine: LLMEngine) -> list[str]:
    """Requests holding a block the prefix cache offers whose tokens are not all computed."""
    s = engine.scheduler
    return [rid for rid, r in s.requests.items() for i, b in enumerate(s.kv.blocks_of(rid))
            if b.block_hash is not None and (i + 1) * s.kv.block_size > r.num_computed_tokens]


def drain(engine: LLMEngine) -> dict[str, tuple[list[int], int]]:
    """Step to the end, checking between steps; each request's (tokens, cached prompt tokens)."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.metrics.num_cached_tokens)
        engine.scheduler.check_invariants()
        assert not findable_beyond_computed(engine)
    return done


def run_batch(model: str, cut_every: int):
    engine = LLMEngine(EngineArgs(model=model, **ENGINE))
    cutter = engine.step_cutter
    assert cutter is not None and engine.model.native_stack is not None
    if cut_every:  # an outranking arrival during every cut_every-th cuttable step (the redo is not cut)
        cutter.on_armed = lambda c: c.offer(0) if c.counts.armed % cut_every == 1 else None
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"b{i}", {"prompt_token_ids": prompt}, greedy(10))
    return {rid: tokens for rid, (tokens, _) in drain(engine).items()}, cutter.counts


def test_forced_cuts_change_no_greedy_token_in_either_forward_path(llama):
    reference, counts = run_batch(llama, 0)
    assert counts.cut == 0 and len(reference) == len(PROMPTS)
    for every in (2, 3):
        outputs, counts = run_batch(llama, every)
        assert outputs == reference
        assert counts.cut_native > 0, "no decode step was cut inside the native layer stack"
        assert counts.cut > counts.cut_native, "no prompt-sized step was cut in the per-layer path"
        assert counts.cut_tokens >= counts.cut
    # the first step admits every prompt: the later ones hit the shared prefix the first makes findable
    assert counts.not_cut == {"a prefix hit on a block this step makes findable": 1}


def test_the_prefix_cache_never_serves_a_cut_steps_blocks(llama):
    prompt = PROMPTS[1]  # 81 tokens: chunks of 16
    alone = LLMEngine(EngineArgs(model=llama, **{**ENGINE, "max_num_batched_tokens": 16}))
    alone.add_request("x", {"prompt_token_ids": prompt}, greedy(8, priority=0))
    expected = drain(alone)["x"][0]

    engine = LLMEngine(EngineArgs(model=llama, **{**ENGINE, "max_num_batched_tokens": 16}))
    batch = None

    def cut_second_chunk(cutter) -> None:
        if batch is not None and batch.num_computed_tokens == 16 and not cutter.counts.cut:
            cutter.offer(0)

    engine.step_cutter.on_armed = cut_second_chunk
    engine.add_request("batch", {"prompt_token_ids": prompt}, greedy(8))
    batch = engine.scheduler.requests["batch"]
    while not engine.step_cutter.counts.cut:
        engine.step()
    assert batch.num_computed_tokens == 16 and not findable_beyond_computed(engine)
    # the interactive request with the same prompt arrives after the cut: it finds the first chunk only
    engine.add_request("interactive", {"prompt_token_ids": prompt}, greedy(8, priority=0))
    done = drain(engine)
    assert done["interactive"][1] == 16
    assert done["interactive"][0] == expected and done["batch"][0][:8] == expected
