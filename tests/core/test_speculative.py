"""Speculative decoding's scheduler side (``core.speculative``), with a fake model whose next token is a fixed
function of the last one: the n-gram index, the length rule, and the scheduler driving proposals through
verification, rollback, chunked prefill, preemption and prefix caching with its invariants checked every step;
with a draft model, the scheduler sends placeholders that the fake executor fills (as ``runner.draft_model``)."""

from __future__ import annotations

import random

import pytest

from conveyor.core import ModelOutput, SchedulerOutput
from conveyor.core.speculative import (
    DRAFT_PLACEHOLDER,
    AcceptanceRate,
    NgramIndex,
    SpeculativeConfig,
    StepCostModel,
    choose_lengths,
)
from tests.helpers.core import make_request, make_scheduler, mirror_table

VOCAB = range(5, 50)


class NextTokenModel:
    """A deterministic 'model': the token after t is ``table[t]``. Keeps the executor's per-request tokens and
    verifies proposals as the runner does (the argmax-matching run, then one more)."""

    def __init__(self, seed: int, noise: float = 0.0) -> None:
        rng = random.Random(seed)
        self.table = {t: rng.choice(VOCAB) for t in VOCAB}
        self.noise_rng, self.noise = rng, noise  # a fraction of contexts where the table is overridden
        self.tokens: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}  # kept as the runner keeps its block table rows
        self.null_block_id: int | None = None  # the KV manager's, with a sliding window
        self.verified = 0

    def next_token(self, tokens: list[int]) -> int:
        last = tokens[-1] if tokens[-1] in self.table else 5
        if self.noise and hash((len(tokens), last)) % 1000 < self.noise * 1000:
            return VOCAB[(last * 7 + len(tokens)) % len(VOCAB)]  # a function of the context, still exact
        return self.table[last]

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """A draft model's greedy proposal: the table's chain, right wherever the noise is not."""
        drafts: list[int] = []
        for _ in range(k):
            last = (tokens + drafts)[-1]
            drafts.append(self.table[last] if last in self.table else 5)
        return drafts

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.block_tables.pop(rid, None)
        starts = {r.request_id: r.num_computed_tokens for r in out.scheduled_cached_reqs}
        for cached in out.scheduled_cached_reqs:
            mirror_table(self.block_tables[cached.request_id], cached, self.null_block_id)
        for new in out.scheduled_new_reqs:
            assert new.request_id not in self.tokens, "executor told twice about a request"
            self.tokens[new.request_id] = list(new.token_ids)
            self.block_tables[new.request_id] = list(new.block_ids)
            starts[new.request_id] = new.num_computed_tokens
        result = ModelOutput()
        for rid, n in out.num_scheduled_tokens.items():
            toks = self.tokens[rid]
            drafts = out.scheduled_spec_tokens.get(rid, [])
            if drafts and drafts[0] == DRAFT_PLACEHOLDER:  # a draft model's turn: the table, without the noise
                assert set(drafts) == {DRAFT_PLACEHOLDER}
                drafts = self.draft(toks, len(drafts))
                out.scheduled_spec_tokens[rid] = drafts
            assert starts[rid] + n - len(drafts) <= len(toks), f"{rid}: scheduled past its tokens"
            if starts[rid] + n - len(drafts) < len(toks):
                assert not drafts, "a prompt chunk got proposals"
                continue
            produced = []
            for draft in [*drafts, None]:
                produced.append(self.next_token(toks + produced))
                if produced[-1] != draft:
                    break
            self.verified += bool(drafts)
            toks += produced
            result.sampled_token_ids[rid] = produced[0]
            if len(produced) > 1:
                result.extra_token_ids[rid] = produced[1:]
        return result


def run(scheduler, model, requests, rng: random.Random, max_steps: int = 20000) -> dict[str, list[int]]:
    """Drive ``requests`` (arriving at random steps) to completion; every step checks the invariants. The
    clock moves by a step cost that grows with the tokens in it, so the length rule has something to fit."""
    pending, outputs, now = list(requests), {}, 0.0
    for _ in range(max_steps):
        while pending and rng.random() < 0.3:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            return outputs
        out = scheduler.schedule(now)
        now += 0.004 + 0.0001 * out.total_num_scheduled_tokens
        result = model.execute(out)
        for rid in out.num_scheduled_tokens:  # the executor's block table is the scheduler's, block for block
            assert model.block_tables[rid] == scheduler.kv.block_ids(rid), f"{rid}: block tables differ"
        for update in scheduler.update(out, result, now):
            outputs.setdefault(update.request_id, []).append(update.new_token_id)
        scheduler.check_invariants()
    raise AssertionError("did not finish")


def traffic(rng: random.Random, n: int, max_model_len: int):
    reqs = []
    for i in range(n):
        prompt_len = rng.randint(1, 40)
        r = make_request(f"r{i}", prompt_len=prompt_len, max_tokens=rng.randint(1, 30),
                         first_token=rng.choice(VOCAB), temperature=0.0)
        r.prompt_token_ids = [rng.choice(VOCAB) for _ in range(prompt_len)]  # in the model's vocabulary
        r.max_model_len = max_model_len
        reqs.append(r)
    return reqs


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("adaptive", [True, False])
def test_speculation_changes_no_token_and_keeps_the_invariants(seed, adaptive):
    rng = random.Random(seed)
    max_model_len = 64
    kw = dict(policy=rng.choice(["chunked", "continuous"]), max_num_seqs=rng.choice([1, 3, 8]),
              max_num_batched_tokens=rng.choice([8, 32, 64]), max_model_len=max_model_len)
    block_size = rng.choice([1, 4, 8])
    num_blocks = rng.randint(max_model_len // block_size, 3 * max_model_len // block_size)
    prefix = rng.random() < 0.5
    spec = {"num_speculative_tokens": rng.choice([1, 3, 5]), "prompt_lookup_min": 1, "adaptive": adaptive}

    def outputs(speculative_config):
        scheduler = make_scheduler(num_blocks, block_size, prefix, speculative_config=speculative_config, **kw)
        model = NextTokenModel(seed, noise=0.2)
        out = run(scheduler, model, traffic(random.Random(seed), 30, max_model_len), random.Random(seed + 1))
        assert not scheduler.running and not scheduler.waiting
        assert scheduler.kv.usage() == 0  # every block back (cached ones are free, just findable)
        return out, scheduler, model

    reference, _, _ = outputs(None)
    got, scheduler, model = outputs(spec)
    assert got == reference
    counters = scheduler.speculator.counters
    assert model.verified == counters.num_drafts > 0
    assert 0 < counters.num_accepted_tokens <= counters.num_draft_tokens
    assert sum(counters.accepted_per_pos) == counters.num_accepted_tokens


@pytest.mark.parametrize("seed", range(4))
def test_draft_model_placeholders_change_no_token_and_keep_the_invariants(seed):
    """Method draft_model: the scheduler sends only placeholders (the executor proposes), and everything after
    (lengths, lookahead blocks, rollback) is the n-gram path's."""
    rng = random.Random(seed)
    kw = dict(policy="chunked", max_num_seqs=rng.choice([1, 4]), max_num_batched_tokens=32, max_model_len=64)
    spec = {"model": "a draft", "num_speculative_tokens": 3, "adaptive": seed % 2 == 0}
    results = []
    for cfg in (None, spec):
        scheduler = make_scheduler(40, 4, True, speculative_config=cfg, **kw)
        model = NextTokenModel(seed, noise=0.2)
        results.append(run(scheduler, model, traffic(random.Random(seed), 20, 64), random.Random(seed + 1)))
        assert scheduler.kv.usage() == 0
    assert results[0] == results[1]
    counters = scheduler.speculator.counters
    assert model.verified == counters.num_drafts > 0 and 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert not scheduler.speculator.ngrams  # no prompt lookup ran


def test_a_model_means_the_draft_model_method():
    assert SpeculativeConfig.parse({"model": "/m"}).proposes_in_executor
    assert not SpeculativeConfig.parse({"method": "ngram"}).proposes_in_executor
    for bad in ({"method": "draft_model"}, {"method": "ngram", "model": "/m"}):
        with pytest.raises(ValueError, match="model"):
            SpeculativeConfig.parse(bad)


@pytest.mark.parametrize("window", [0, 6])
def test_preemption_with_speculation_changes_no_token(window):
    """With a sliding window too: proposals' lookahead blocks and their rollback beside the blocks given back."""
    rng = random.Random(3)
    kw = dict(policy="chunked", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    results = []
    for cfg in (None, spec):
        # 72 slots for 8 requests: tight (with the window too: a preemption or two)
        scheduler = make_scheduler(18 if not window else 10, 4, True, speculative_config=cfg, sliding_window=window,
                                   **kw)
        model = NextTokenModel(3)
        model.null_block_id = scheduler.kv.null_block_id
        results.append(run(scheduler, model, traffic(random.Random(3), 24, 64), rng))
        assert scheduler.num_preemptions > 0
        assert scheduler.kv.usage() == 0
    assert results[0] == results[1]


def test_a_thousand_requests_leak_no_block_and_no_index():
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1}
    scheduler = make_scheduler(64, 4, True, speculative_config=spec, max_num_seqs=16, max_model_len=64)
    rng = random.Random(0)
    run(scheduler, NextTokenModel(0, noise=0.3), traffic(rng, 1000, 64), rng, max_steps=200000)
    assert scheduler.kv.usage() == 0 and not scheduler.kv.req_blocks
    assert not scheduler.speculator.ngrams and not scheduler.speculator.acceptance
    assert scheduler.speculator.counters.num_drafts > 0


def test_only_requests_drawn_from_the_logits_alone_speculate():
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    scheduler = make_scheduler(64, 4, speculative_config=spec)
    prompt = [7, 8, 9] * 5  # repeats: prompt lookup always proposes
    kinds = dict(greedy=dict(temperature=0.0), sampled=dict(temperature=0.8, top_p=0.9),
                 seeded=dict(temperature=0.8, seed=1),
                 logprobs=dict(temperature=0.0, logprobs=1), penalty=dict(temperature=0.0, presence_penalty=0.5),
                 min_tokens=dict(temperature=0.0, min_tokens=5))
    for rid, params in kinds.items():
        r = make_request(rid, max_tokens=8, **params)
        r.prompt_token_ids = list(prompt)
        scheduler.add_request(r)
    model = NextTokenModel(0)
    model.table.update({7: 8, 8: 9, 9: 7})
    seen = set()
    for _ in range(4):
        out = scheduler.schedule(0.0)
        seen |= set(out.scheduled_spec_tokens)
        scheduler.update(out, model.execute(out), 0.0)
    assert seen == {"greedy", "sampled"}


def test_proposals_never_run_past_max_tokens_or_the_context():
    spec = {"num_speculative_tokens": 8, "prompt_lookup_min": 1, "adaptive": False}
    scheduler = make_scheduler(64, 4, speculative_config=spec, max_model_len=20)
    a = make_request("a", max_tokens=3, temperature=0.0)
    b = make_request("b", max_tokens=100, temperature=0.0)
    for r in (a, b):
        r.prompt_token_ids = [7, 8, 9] * 5
        r.max_model_len = 20
        scheduler.add_request(r)
    model = NextTokenModel(0)
    model.table.update({7: 8, 8: 9, 9: 7})
    outputs = run(scheduler, model, [], random.Random(0))
    assert len(outputs["a"]) == 3 and len(outputs["b"]) == 5  # max_tokens; 20 - 15 prompt tokens


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # suffix [1, 2, 3] occurred at the start, followed by 4 9 2
    assert index.propose(3) == [4, 9, 2]
    index.extend([5])  # suffix [2, 3, 5] occurred once, followed by 6 1 2
    assert index.propose(3) == [6, 1, 2]
    index.extend([7])  # no earlier 7
    assert index.propose(3) == []
    incremental = NgramIndex(2, 2)
    for t in [4, 5, 4, 5]:
        incremental.extend([t])
    assert incremental.propose(4) == [4, 5]


def test_length_rule_speculates_on_a_small_batch_and_not_on_a_full_step():
    alphas = {"a": 0.8, "b": 0.8}
    cost = (0.003, 0.0003)  # 3 ms fixed, 0.3 ms per token: the default model's decode steps on 2 vCPUs
    small = choose_lengths({"a": 4, "b": 4}, alphas, step_tokens=2, useful_tokens=2, cost=cost, budget=100)
    assert small == {"a": 4, "b": 4}
    # a step of 64 decodes: it is compute-bound, one more token costs about what a decode yields
    full = choose_lengths({"a": 4, "b": 4}, alphas, step_tokens=64, useful_tokens=64, cost=cost, budget=100)
    assert full == {}
    # the same step with a rate near one still pays
    assert choose_lengths({"a": 4}, {"a": 0.99}, 64, 64, cost, 100) == {"a": 4}
    # a request that keeps being rejected gets fewer tokens than one that is accepted
    mixed = choose_lengths({"a": 4, "b": 4}, {"a": 0.95, "b": 0.2}, 40, 40, cost, 100)
    assert mixed.get("a", 0) > mixed.get("b", 0)
    assert choose_lengths({"a": 4}, {"a": 0.9}, 1, 1, cost, budget=2) == {"a": 2}


def test_acceptance_rate_and_cost_fit():
    rate = AcceptanceRate()
    for _ in range(50):
        rate.observe(4, 4)
    assert rate.alpha > 0.95
    for _ in range(200):
        rate.observe(4, 0)
    assert rate.alpha < 0.5
    model = StepCostModel()
    assert model.fit() is None
    for n in (1, 5, 10, 50):
        model.observe(n, 0.002 + 0.0001 * n)
    fixed, per_token, chunk = model.fit()
    assert fixed == pytest.approx(0.002) and per_token == pytest.approx(0.0001) and chunk == 0.0
    with_chunks = StepCostModel()  # decode-only steps, and steps that verify (another path: 3 ms more)
    for n in (1, 2, 4):
        with_chunks.observe(n, 0.004 + 0.0001 * n)
    for n in (5, 9, 13, 17):
        with_chunks.observe(n, 0.007 + 0.0001 * n, has_chunk=True)
    assert with_chunks.fit() == pytest.approx((0.004, 0.0001, 0.003))


def test_the_chunk_cost_is_paid_once_for_the_whole_choice():
    cost = (0.004, 0.0001, 0.003)
    # a decode-only step of 4: one proposal of 2 does not repay the jump to the chunk path; four of 4 do
    assert choose_lengths({"a": 2}, {"a": 0.6}, 4, 4, cost, 100, has_chunk=False) == {}
    many = {f"r{i}": 4 for i in range(4)}
    assert choose_lengths(many, {r: 0.9 for r in many}, 4, 4, cost, 100, has_chunk=False) == many
    # in a step that already has a prompt chunk, the same single proposal pays
    assert choose_lengths({"a": 2}, {"a": 0.6}, 4, 4, cost, 100, has_chunk=True) == {"a": 2}


@pytest.mark.parametrize("bad", ['{"method": "eagle"}', '{"num_speculative_tokens": 0}', "not json",
                                 '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', '{"nmu_speculative": 3}'])
def test_bad_speculative_configs_are_refused_clearly(bad):
    with pytest.raises(ValueError):
        SpeculativeConfig.parse(bad)


def test_speculation_refuses_the_baselines_and_the_slab():
    from conveyor.core import Scheduler, SchedulerConfig
    from conveyor.core.slab_manager import SlabKVManager

    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="static", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="paged"):
        Scheduler(SchedulerConfig(max_model_len=32, speculative_config='{"method": "ngram"}'),
                  SlabKVManager(64, 4, 32))


def test_cost_fit_near_a_size_ignores_long_prompt_chunks():
    model = StepCostModel()
    for n, t in ((1, 0.0040), (3, 0.0041), (5, 0.0042), (9, 0.0044), (512, 0.30), (600, 0.36)):
        model.observe(n, t)
    whole, near = model.fit(), model.fit(up_to=20)
    assert whole[1] > 5e-4  # the prompt chunks' compute-bound cost per token
    assert near[1] == pytest.approx(5e-5, rel=0.05) and near[0] == pytest.approx(0.00395, rel=0.05)
    assert model.fit(up_to=1) is None  # one size only


def test_a_request_with_a_low_rate_probes_again_after_a_while():
    rate = AcceptanceRate()
    for _ in range(30):
        rate.observe(4, 0)
    assert rate.alpha < 0.1
    due = [rate.due_for_probe() for _ in range(AcceptanceRate.PROBE_AFTER_STEPS)]
    assert due[-1] and not any(due[:-1])
    rate.observe(1, 1)
    assert not rate.due_for_probe()


def test_a_probe_waits_for_a_step_that_already_pays_the_multi_token_path():
    """A request whose rate fell tries one token again, at the traffic's rate, judged with the chunk cost: on a
    step of decodes alone (where its one token would put every row on the multi-token path) it waits; on a step
    that already has a prompt chunk it probes."""
    spec = {"num_speculative_tokens": 4, "prompt_lookup_min": 1}
    scheduler = make_scheduler(256, 4, False, speculative_config=spec, max_num_seqs=8, policy="chunked",
                               max_num_batched_tokens=32)
    model = NextTokenModel(0)
    model.table.update({7: 8, 8: 9, 9: 7})
    decoders = []
    for i in range(4):
        r = make_request(f"d{i}", max_tokens=200, temperature=0.0)
        r.prompt_token_ids = [7, 8, 9] * 4  # prompt lookup always proposes
        scheduler.add_request(r)
        decoders.append(r.request_id)
    for _ in range(3):  # prefill them; then every one decodes
        out = scheduler.schedule(0.0)
        scheduler.update(out, model.execute(out), 0.0)
    for n in (1, 2, 3, 4, 5, 6, 8):  # decode steps: 10 ms and 0.1 ms a token; a multi-token row adds 10 ms
        scheduler.speculator.cost.observe(n, 0.010 + 0.0001 * n, has_chunk=False)
        scheduler.speculator.cost.observe(n + 4, 0.020 + 0.0001 * (n + 4), has_chunk=True)
    scheduler.speculator.rate = AcceptanceRate(prior_alpha=0.3, prior_weight=1000.0)  # a traffic of poor proposals
    for rid in decoders:
        rate = scheduler.speculator.acceptance[rid] = AcceptanceRate(0.3)
        for _ in range(30):
            rate.observe(4, 0)
        rate.steps_without = AcceptanceRate.PROBE_AFTER_STEPS  # due
    out = scheduler.schedule(0.0)
    assert set(out.num_scheduled_tokens) == set(decoders) and not out.scheduled_spec_tokens
    scheduler.update(out, model.execute(out), 0.0)
    newcomer = make_request("p", prompt_len=20, max_tokens=4, temperature=0.0)
    newcomer.prompt_token_ids = [7, 8, 9, 10, 11] * 4
    scheduler.add_request(newcomer)
    out = scheduler.schedule(0.0)
    assert out.num_scheduled_tokens["p"] > 1
    assert out.scheduled_spec_tokens and all(len(d) == 1 for d in out.scheduled_spec_tokens.values())


def test_cost_fit_is_reused_for_a_few_steps_then_refitted():
    model = StepCostModel()
    for n in (1, 2, 3, 4):
        model.observe(n, 0.010 + 0.001 * n)
    first = model.fit(up_to=5)
    assert first[1] == pytest.approx(0.001) and model.fit(up_to=8) is first  # 5 and 8 share the bound 8
    for _ in range(StepCostModel.REFIT_AFTER - 1):
        model.observe(6, 0.010 + 0.003 * 6)  # the cost per token moved
    assert model.fit(up_to=8) is first
    model.observe(6, 0.010 + 0.003 * 6)
    assert model.fit(up_to=8)[1] > 0.0015
    assert model.fit(up_to=4)[1] == pytest.approx(0.001)  # the steps of 6 tokens lie above that bound
