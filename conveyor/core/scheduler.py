"""The scheduler: re-decides the batch at every step (iteration-level scheduling).

Mechanism lives here (the token budget, the KV manager, preemption, the queues); decisions live in the policy,
which hands them back as values (``policies.base``). ``schedule(now)`` grants each chosen request
``num_new_tokens`` so that its ``num_computed_tokens`` catches up with ``num_tokens``; ``update(...)`` appends
the sampled tokens and applies the policy's decision on every request that finished.
"""

from __future__ import annotations


from conveyor.core.budget import TokenBudget
from conveyor.core.config import SchedulerConfig
from conveyor.core.interfaces import KVManager
from conveyor.core.kv_eviction import EvictionConfig, KVEvictor
from conveyor.core.outputs import (
    CachedRequestData,
    ModelOutput,
    NewRequestData,
    RequestUpdate,
    SchedulerOutput,
    SchedulerStats,
    is_decode,
)
from conveyor.core.policies import OnFinish, Room, SchedulingPolicy, WaitingQueue, make_policy
from conveyor.core.request import Request, RequestStatus
from conveyor.core.speculative import (
    DRAFT_PLACEHOLDER,
    AcceptanceRate,
    NgramIndex,
    SpecDecodeCounters,
    StepCostModel,
    choose_lengths,
    speculates,
    worth_proposing,
)

# When a step schedules nothing while requests wait and none runs, only time or a new request can change that
# (a dynamic batch forming until max_wait_ms; the engine's requests waiting for a grammar): a driver asks again
# after this long. One period for every driver (the engine's step loop, the in-process replay, the simulator),
# so the simulator schedules a trace as the real engine does.
IDLE_POLL_S = 0.001


class Scheduler:
    """Owns the waiting queue and running batch; talks to a KV manager, never to the model."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager,
                 kv_eviction: EvictionConfig | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.policy: SchedulingPolicy = make_policy(config)
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = self.policy.waiting_queue()
        self.running: list[Request] = []  # admission order: the tail is the newest
        self._finished_ids: set[str] = set()  # to tell the executor at the next schedule()
        self._seen_by_executor: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0
        self.spec = config.speculative_config  # None: no speculative decoding
        if self.spec is not None and getattr(kv_manager, "layout", None) != "paged":
            raise ValueError("speculative decoding needs the paged KV layout (its rejected slots are given back)")
        self._ngrams: dict[str, NgramIndex] = {}
        self._acceptance: dict[str, AcceptanceRate] = {}
        self._kept_blocks: dict[str, int] = {}  # requests trimmed since their last step: blocks they kept
        self.spec_cost = StepCostModel()
        self.spec_rate = AcceptanceRate()  # over every request: a new request's prior
        self.spec_counters = SpecDecodeCounters()
        self._step_start = 0.0
        # KV eviction (None: off, and nothing below it runs): blocks dropped this step, to tell the executor
        self.evictor = self._make_evictor(kv_eviction)
        self._evicted: dict[str, list[int]] = {}

    def _make_evictor(self, eviction: EvictionConfig | None) -> KVEvictor | None:
        """The eviction policy's decisions, after refusing what it cannot run beside."""
        if eviction is None or not eviction.enabled:
            return None
        if getattr(self.kv, "layout", None) != "paged":
            raise ValueError("KV eviction needs the paged KV layout (it gives blocks back to the pool)")
        if self.spec is not None:
            raise ValueError("KV eviction and speculative decoding do not run together yet (a rejected proposal's "
                             "slots are given back by position, which eviction shifts)")
        if self.config.policy not in ("continuous", "chunked"):
            raise ValueError(f"KV eviction runs with the continuous or chunked policy, not {self.config.policy!r} "
                             f"(the baselines pad batches and park finished requests in fixed slots)")
        return KVEvictor(eviction, self.kv.block_size)

    # ---- queue ------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_request(self, request_id: str, status: RequestStatus, now: float) -> None:
        """Finish a request from outside the step (abort, stop string): its blocks are freed now.

        A no-op for a request that is unknown or already finished for its user."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.mark_finished(status, now)
        self._retire(request)

    def _retire(self, request: Request) -> None:
        """Forget a request that is finished and out of the queues: free its blocks, tell the executor."""
        request.status = RequestStatus(request.finish_reason)  # FINISHED_*: the values are the finish reasons
        self.kv.free(request)
        self._ngrams.pop(request.request_id, None)
        self._acceptance.pop(request.request_id, None)
        self._kept_blocks.pop(request.request_id, None)
        self._forget_eviction(request.request_id)
        del self.requests[request.request_id]
        if request.request_id in self._seen_by_executor:
            self._seen_by_executor.discard(request.request_id)
            self._finished_ids.add(request.request_id)

    def make_stats(self) -> SchedulerStats:
        """An immutable snapshot for readers on other threads."""
        kv, spec = self.kv, self.spec_counters
        return SchedulerStats(self.num_running, self.num_waiting, kv.usage(), self.num_preemptions,
                              kv.prefix_queries, kv.prefix_hits, spec.num_drafts, spec.num_draft_tokens,
                              spec.num_accepted_tokens, tuple(spec.accepted_per_pos or ()),
                              kv.num_evicted_blocks)

    # ---- one step ---------------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        for request in self.policy.begin_step(self.running, self.waiting, now):
            self.running.remove(request)
            self._retire(request)
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = TokenBudget(self.policy)
        cost = self.spec_cost.fit() if self.config.priority_step_slack is not None else None
        room = Room(self.config.max_num_seqs - len(self.running), round(self.kv.num_blocks * (1 - self.kv.usage())),
                    self.kv.block_size, cost)
        yielded = self.policy.yield_to_waiting(self.running, self.waiting, room)
        for request in yielded.preempt:  # room for requests that outrank them: those admit this step
            self._preempt(request, out)
        preempted_any = self._schedule_running(budget, out, yielded.caps or {})
        if not preempted_any:  # admitting in a step that preempted would only thrash
            self._admit(budget, now, out, yielded.admit_cap)
        if self.spec is not None:
            self._speculate(budget, out)
        self._step_start = now
        out.num_padding_tokens, out.num_idle_slot_tokens = self.policy.end_step(out, self.running)
        self.num_steps += 1
        return out

    def _schedule_running(self, budget: TokenBudget, out: SchedulerOutput, caps: dict[str, int]) -> bool:
        """Running requests: decodes first, then unfinished prompt chunks (stall-free chunked prefill), in the
        policy's order, each at most the tokens the policy ``caps`` it to this step. Preempts from the policy's
        victims when blocks run out; returns whether it did."""
        behind = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running}
        decodes = [r for r in self.running if is_decode(behind[r.request_id])]
        prefills = [r for r in self.running if behind[r.request_id] > 1]
        scheduled: set[str] = set()
        preempted_any = False
        for request in self.policy.order_running(decodes + prefills):
            if budget.exhausted:
                break
            cap = caps.get(request.request_id, behind[request.request_id])
            if not request.status.holds_slot or cap == 0:
                continue  # preempted (or retired) earlier in this loop, or making room for others this step
            num_new = budget.grant(self._capped(request, min(behind[request.request_id], cap)),
                                   self.config.whole_prompts)
            if num_new == 0:
                continue
            if self.evictor is not None:
                self._evict(request, num_new)
            while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self.policy.choose_victim([r for r in self.running if r.request_id not in scheduled])
                self._preempt(victim, out)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                continue
            self._emit(request, num_new, new_blocks, out)
            scheduled.add(request.request_id)
            budget.spend(num_new)
        return preempted_any

    def _admit(self, budget: TokenBudget, now: float, out: SchedulerOutput,
               cap: tuple[int, int] | None = None) -> None:
        """Waiting requests join in queue order while seats, budget and blocks last; those of a priority worse than
        ``cap``'s take at most its tokens in all."""
        below = cap[1] if cap is not None else None
        while self.waiting and not budget.exhausted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.policy.admits(request):
                break
            capped = below is not None and request.priority > cap[0]
            if capped and below <= 0:
                break
            # A waiting request normally holds no KV (new, or preempted and reset to 0): it starts from a prefix-
            # cache lookup. One handed over with its KV already computed elsewhere (a disaggregated prefill
            # instance's, see sim/cluster.py) keeps that count: blocks are allocated here for all its tokens and only
            # the rest is scheduled, as vLLM's scheduler counts a KV connector's external tokens.
            handed_over = request.num_computed_tokens
            hit_blocks, hit_tokens = ([], 0)
            if handed_over == 0:
                hit_blocks, hit_tokens = self.kv.get_computed_blocks(request)
                if self.evictor is not None and (most := self.evictor.max_hit_blocks(request)) is not None \
                        and len(hit_blocks) > most:  # a hit and the first chunk must fit the budget
                    hit_blocks = hit_blocks[:most]
                    hit_tokens = most * self.kv.block_size
            behind = self._capped(request, request.num_tokens - handed_over - hit_tokens)
            num_new = budget.grant(min(behind, below) if capped else behind, self.config.whole_prompts)
            if num_new == 0:
                break
            new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                break  # FCFS: the head of the queue waits for room; nobody jumps it
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = hit_tokens
            request.num_computed_tokens = handed_over + hit_tokens
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
            self.running.append(request)
            self._emit(request, num_new, new_blocks, out)
            budget.spend(num_new)
            if capped:
                below -= num_new

    def _speculate(self, budget: TokenBudget, out: SchedulerOutput) -> None:
        """Give this step's decodes that may speculate their proposed tokens, as many as the rule in
        ``core.speculative`` chooses, from the budget and the free blocks that the step left (speculation never
        preempts or delays anyone's prompt)."""
        if budget.exhausted:
            return
        adaptive = self.spec.adaptive
        step_tokens = out.total_num_scheduled_tokens
        useful = sum(1 for rid, n in out.num_scheduled_tokens.items()
                     if self.requests[rid].num_computed_tokens + n >= self.requests[rid].num_tokens)
        # the step's cost around the sizes this decision can reach: up to every decode's full proposal, twice
        reach = 2 * (step_tokens + self.spec.num_speculative_tokens * useful)
        cost = self.spec_cost.fit(up_to=reach) if adaptive else None
        proposals: dict[str, list[int]] = {}
        alphas: dict[str, float] = {}
        probes: set[str] = set()  # requests whose low rate is tried again with one token
        for data in out.scheduled_cached_reqs:
            rid = data.request_id
            request = self.requests[rid]
            if out.num_scheduled_tokens[rid] != 1 or request.num_computed_tokens + 1 != request.num_tokens or \
                    not speculates(request.sampling_params, request.num_output_tokens):
                continue
            rate = self._acceptance.get(rid)
            alpha = alphas[rid] = rate.alpha if rate is not None else self.spec_rate.alpha
            if adaptive and not worth_proposing(alpha, step_tokens, useful, cost):
                affordable = worth_proposing(self.spec_rate.alpha, step_tokens, useful, cost)
                if rate is None or not (rate.due_for_probe() and affordable):
                    continue  # not even its first token would pay: skip the lookup
                # tried as a request of the traffic's rate, one token, judged with the rest (so a probe that
                # would put the multi-token path's cost on a step of decodes waits for a step that has it)
                probes.add(rid)
                alphas[rid] = self.spec_rate.alpha
            # beyond the token it always samples: what max_tokens and the context leave
            room = request.max_output_tokens() - request.num_output_tokens - 1
            if self.config.max_model_len is not None:
                room = min(room, self.config.max_model_len - request.num_tokens - 1)
            if room <= 0:
                continue
            most = min(self.spec.num_speculative_tokens, room)
            if self.spec.proposes_in_executor:  # the draft model fills them in, in the step
                proposals[rid] = [DRAFT_PLACEHOLDER] * most
            elif drafts := self._ngram_index(request).propose(most):
                proposals[rid] = drafts
        if not proposals:
            return
        if adaptive:
            has_chunk = any(n > 1 for n in out.num_scheduled_tokens.values())
            lengths = choose_lengths({rid: 1 if rid in probes else len(d) for rid, d in proposals.items()}, alphas,
                                     step_tokens, useful, cost, budget.left, has_chunk)
        else:
            lengths = {rid: len(d) for rid, d in proposals.items()}
        cached = {data.request_id: data for data in out.scheduled_cached_reqs}
        for rid, k in lengths.items():
            k = min(k, budget.left)
            if k <= 0:
                break
            request = self.requests[rid]
            new_blocks = self.kv.allocate_slots(request, 1, num_lookahead_tokens=k)
            if new_blocks is None:
                continue  # no free block for the proposals: it decodes one token, as without speculation
            cached[rid].new_block_ids.extend(new_blocks)
            out.scheduled_spec_tokens[rid] = proposals[rid][:k]
            out.num_scheduled_tokens[rid] += k
            out.total_num_scheduled_tokens += k
            budget.spend(k)

    def _ngram_index(self, request: Request) -> NgramIndex:
        """The request's prompt-lookup index, brought up to its tokens so far."""
        index = self._ngrams.get(request.request_id)
        if index is None:
            index = self._ngrams[request.request_id] = NgramIndex(self.spec.prompt_lookup_min,
                                                                 self.spec.prompt_lookup_max)
            index.extend(request.prompt_token_ids)
        index.extend(request.output_token_ids[len(index.tokens) - request.num_prompt_tokens:])
        return index

    def _capped(self, request: Request, behind: int) -> int:
        """``behind``, or less where KV eviction caps a prompt chunk to fit the request's budget."""
        if self.evictor is None or (cap := self.evictor.chunk_cap(request)) is None:
            return behind
        return min(behind, cap)

    def _evict(self, request: Request, num_new: int) -> None:
        """Give back the blocks the eviction policy drops before ``num_new`` more tokens are allocated."""
        rid = request.request_id
        indices = self.evictor.choose(request, self.kv.req_blocks[rid], num_new)
        if indices:
            assert rid not in self._evicted, "evicted twice in one step"
            self.kv.evict_blocks(request, indices)
            self.evictor.on_evicted(rid, indices)
            self._evicted[rid] = indices

    def _forget_eviction(self, request_id: str) -> None:
        if self.evictor is not None:
            self.evictor.forget(request_id)
            self._evicted.pop(request_id, None)

    def _emit(self, request: Request, num_new: int, new_blocks: list[int], out: SchedulerOutput) -> None:
        rid = request.request_id
        if self.evictor is not None and (rows := self.evictor.score_rows(request, num_new)):
            out.kv_score_rows[rid] = rows
        if rid in self._seen_by_executor:
            out.scheduled_cached_reqs.append(CachedRequestData(rid, new_blocks, request.num_computed_tokens,
                                                               self._kept_blocks.pop(rid, None),
                                                               self._evicted.pop(rid, None),
                                                               request.num_evicted_tokens,
                                                               self.kv.num_skipped_blocks(rid)))
        else:
            assert request.num_evicted_tokens == 0, "a request is sent whole only with its whole KV"
            self._seen_by_executor.add(rid)
            out.scheduled_new_reqs.append(NewRequestData(
                rid, request.all_token_ids, request.num_prompt_tokens, request.sampling_params,
                self.kv.block_ids(rid), request.num_computed_tokens))
        out.num_scheduled_tokens[rid] = num_new
        out.total_num_scheduled_tokens += num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request's blocks to make room. Recompute preemption: it goes back to the head of the
        queue and resumes later with prompt + outputs so far. One already finished for its user owes nothing
        to recompute, so it leaves instead."""
        self.running.remove(request)
        if request.is_finished:
            self._retire(request)
            return
        self.kv.free(request)
        self._kept_blocks.pop(request.request_id, None)  # it is sent whole again
        self._forget_eviction(request.request_id)  # and recomputed exactly
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if request.request_id in self._seen_by_executor:
            self._seen_by_executor.discard(request.request_id)
            out.preempted_req_ids.add(request.request_id)

    def update(self, sched_out: SchedulerOutput, model_out: ModelOutput, now: float) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, apply the policy's decision on finished requests."""
        updates: list[RequestUpdate] = []
        # the step's measured cost: speculation's lengths and priority's step slack are decided from it
        self.spec_cost.observe(sched_out.total_num_scheduled_tokens, now - self._step_start,
                               any(n > 1 for n in sched_out.num_scheduled_tokens.values()))
        if self.evictor is not None:
            for rid, scores in model_out.kv_block_scores.items():
                request = self.requests.get(rid)
                if request is not None and request.status.holds_slot:
                    # the step's scored rows are its last ones, at these KV slots (before the advance below)
                    end = request.num_computed_tokens + sched_out.num_scheduled_tokens.get(rid, 0) \
                        - request.num_evicted_tokens
                    rows = sched_out.kv_score_rows.get(rid, 0)
                    self.evictor.add_scores(rid, scores, (end - rows, end))
        for rid, num_new in sched_out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or not request.status.holds_slot:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new
            if request.is_pooling:
                if request.num_computed_tokens >= request.num_prompt_tokens and rid not in model_out.failed:
                    updates.append(self._finish_pooled(request, model_out.pooled.get(rid), now))
                continue
            token = model_out.sampled_token_ids.get(rid)
            drafts = sched_out.scheduled_spec_tokens.get(rid)
            tokens = [] if token is None else [token]
            if drafts:
                tokens += model_out.extra_token_ids.get(rid, [])
                self._verified(request, len(drafts), len(tokens) - 1 if tokens else 0)
            for token in tokens:
                if not request.append_token(token):
                    break  # a parked slot's token (computed for real, nobody's output)
                if request.times.first_token is None:
                    request.times.first_token = now
                request.times.last_token = now
                stop = request.stop_decision(token)
                if stop is not None:
                    request.mark_finished(stop.status, now)
                    if self.policy.on_finished(request) is OnFinish.PARK:
                        request.status = RequestStatus.PARKED
                    else:
                        self.running.remove(request)
                        self._retire(request)
                updates.append(RequestUpdate(rid, token, model_out.logprobs.get(rid),
                                             request.finish_reason if stop is not None else None,
                                             stop.stop_reason if stop is not None else None,
                                             request.num_cached_prompt_tokens,
                                             request.num_preemptions, request.times.first_scheduled))
                if stop is not None:
                    break  # tokens accepted past a stop are nobody's
        return updates

    def _finish_pooled(self, request: Request, pooled: list[float] | None, now: float) -> RequestUpdate:
        """A prefill-only request's prompt is computed: it finishes now with its pooled result and frees its
        blocks (every policy retires it: a padded baseline's slot has nothing left to decode)."""
        request.times.first_token = request.times.last_token = now
        request.mark_finished(RequestStatus.FINISHED_STOPPED, now)
        self.running.remove(request)
        self._retire(request)
        return RequestUpdate(request.request_id, -1, None, request.finish_reason, None,
                             request.num_cached_prompt_tokens, request.num_preemptions, request.times.first_scheduled,
                             pooled)

    def _verified(self, request: Request, proposed: int, accepted: int) -> None:
        """Roll a request back past its rejected proposals: their KV is not its tokens' (the slots after
        ``num_computed_tokens`` are rewritten by the next step), and the blocks only they used go back."""
        request.num_computed_tokens -= proposed - accepted
        kept = self.kv.trim(request, request.num_computed_tokens + 1)
        if kept is not None:
            self._kept_blocks[request.request_id] = kept
        self._acceptance.setdefault(request.request_id, AcceptanceRate(self.spec_rate.alpha)).observe(proposed,
                                                                                                   accepted)
        self.spec_rate.observe(proposed, accepted)
        self.spec_counters.record(proposed, accepted)

    # ---- checks -----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The KV manager's invariants plus the scheduler's own bookkeeping."""
        self.kv.check_invariants()
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert len(ids) == len(set(ids)), "a request is both running and waiting"
        assert set(ids) <= set(self.requests), "a queued request is not registered"
        assert len(self.running) <= self.config.max_num_seqs, "more running requests than max_num_seqs"
        for request in self.waiting:
            assert not self.kv.block_ids(request.request_id), f"waiting {request.request_id} holds blocks"
        for request in self.running:
            assert request.status.holds_slot, f"running {request.request_id} is {request.status}"
            assert request.num_computed_tokens <= request.num_tokens
        if self.evictor is not None:
            self.evictor.check_invariants(self.kv, self.requests.values(), self.running)
