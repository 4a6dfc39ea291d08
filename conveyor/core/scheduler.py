"""The scheduler: re-decides the batch at every step (iteration-level scheduling).

Mechanism lives here (the token budget, the KV manager, preemption, the queues); decisions live in policy
objects that hand them back as values: the batching policy (``policies.base``), and, when they are on, KV
eviction's ``KVEvictor`` (``core.kv_eviction``), speculative decoding's ``Speculator`` (``core.speculator``) and the LoRA
adapter slots' ``AdapterSlots`` (``policies.adapter_slots``).
``schedule(now)`` grants each chosen request ``num_new_tokens`` so that its ``num_computed_tokens`` catches up
with ``num_tokens``; ``update(...)`` appends the sampled tokens and applies the policy's decision on every request
that finished.
"""

from __future__ import annotations

from conveyor.core.budget import TokenBudget
from conveyor.core.config import SchedulerConfig
from conveyor.core.interfaces import KVManager
from conveyor.core.invariants import check_scheduler
from conveyor.core.kv_eviction import KVEvictor
from conveyor.core.outputs import (
    CachedRequestData, ModelOutput, NewRequestData, RequestUpdate, SchedulerOutput, SchedulerStats, is_decode,
)
from conveyor.core.policies import OnFinish, Room, SchedulingPolicy, WaitingQueue, make_policy
from conveyor.core.policies.adapter_slots import AdapterSlots
from conveyor.core.request import Request, RequestStatus, StopDecision
from conveyor.core.speculative import SpecDecodeCounters, StepCostModel
from conveyor.core.speculator import Speculator


class Scheduler:
    """Owns the waiting queue and running batch; talks to a KV manager, never to the model."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager) -> None:
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
        # The policy objects that are on (None: off, and nothing of theirs runs). Both give blocks back to the pool
        # in the middle of a request's life, which only the paged layout does.
        spec, eviction = config.speculative_config, config.eviction
        if (spec is not None or eviction is not None) and kv_manager.layout != "paged":
            raise ValueError(f"{'speculative decoding' if spec else 'KV eviction'} needs the paged KV layout")
        # The step's measured cost (the caller's clock): speculation's lengths and priority's step slack read it
        self.step_cost = StepCostModel()
        self._policy_cost: tuple[float, float, float] | None = None  # the last line fitted for the policy
        self.speculator = Speculator(spec, config.max_model_len, self.step_cost) if spec is not None else None
        self._kept_blocks: dict[str, int] = {}  # requests trimmed since their last step: blocks they kept
        self.evictor = KVEvictor(eviction, kv_manager.block_size) if eviction is not None else None
        self._evicted: dict[str, list[int]] = {}  # blocks eviction dropped this step, to tell the executor
        # At most max_loras distinct LoRA adapters in the batch (None: no bound, max_loras 0)
        self.adapter_slots = AdapterSlots(config.max_loras) if config.max_loras else None

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
        if self._release_kv(request):
            self._finished_ids.add(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        del self.requests[request.request_id]

    def make_stats(self) -> SchedulerStats:
        """An immutable snapshot for readers on other threads."""
        kv, spec = self.kv, self.speculator.counters if self.speculator is not None else SpecDecodeCounters()
        return SchedulerStats(self.num_running, self.num_waiting, kv.usage(), self.num_preemptions, kv.prefix_queries,
                              kv.prefix_hits, spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                              tuple(spec.accepted_per_pos or ()), kv.num_evicted_blocks)

    # ---- one step ---------------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        for request in self.policy.begin_step(self.running, self.waiting, now):
            self.running.remove(request)
            self._retire(request)
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        self.kv.begin_step()
        if self.config.uses_step_cost:
            # A window of steps of one size (a lone interactive decode for as many steps) fits no line: the last
            # line stands, or the policy's caps would lapse exactly while one request decodes alone.
            self._policy_cost = self.step_cost.fit() or self._policy_cost
        room = Room(self.config.max_num_seqs - len(self.running), self.kv.num_free_blocks, self.kv.block_size,
                    self._policy_cost)
        yielded = self.policy.yield_to_waiting(self.running, self.waiting, room)
        for request in yielded.preempt:  # room for requests that outrank them: those admit this step
            self._preempt(request, out)
        budget = TokenBudget(self.policy, self.config.whole_prompts, self.evictor, yielded)
        preempted_any = self._schedule_running(budget, out)
        if not preempted_any:  # admitting in a step that preempted would only thrash
            self._admit(budget, now, out)
        if self.speculator is not None:
            self._speculate(budget, out)
        self.step_cost.step_started(now)
        out.num_padding_tokens, out.num_idle_slot_tokens = self.policy.end_step(out, self.running)
        self.num_steps += 1
        return out

    def _schedule_running(self, budget: TokenBudget, out: SchedulerOutput) -> bool:
        """Running requests: decodes first, then unfinished prompt chunks (stall-free chunked prefill), in the
        policy's order, each at most what the budget grants it (a request making room for others: none).
        Preempts from the policy's victims when blocks run out; returns whether it did."""
        behind = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.running}
        decodes = [r for r in self.running if is_decode(behind[r.request_id])]
        prefills = [r for r in self.running if behind[r.request_id] > 1]
        scheduled: set[str] = set()
        preempted_any = False
        for request in self.policy.order_running(decodes + prefills):
            if budget.exhausted:
                break
            if not request.status.holds_slot:
                continue  # preempted (or retired) earlier in this loop
            num_new = budget.grant(request, behind[request.request_id])
            if num_new == 0:
                continue  # no room in the budget, or making room for others this step
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

    def _admit(self, budget: TokenBudget, now: float, out: SchedulerOutput) -> None:
        """Waiting requests join in queue order while seats, budget, blocks and adapter slots last."""
        slots = self.adapter_slots
        if slots is not None:
            slots.begin(self.running)
        while self.waiting and not budget.exhausted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.policy.admits(request) or budget.closed_to(request):
                break
            if slots is not None and not slots.admits(request):
                break  # every adapter slot holds an adapter with running requests: it waits for one to empty
            # A waiting request normally holds no KV (new, or preempted and reset to 0): it starts from a prefix-
            # cache lookup. One handed over with its KV computed elsewhere (disaggregated prefill) keeps that count:
            # blocks are allocated for all its tokens, only the rest is scheduled (vLLM's external tokens).
            handed_over = request.num_computed_tokens
            hit_blocks, hit_tokens = ([], 0)
            if handed_over == 0:
                hit_blocks, hit_tokens = self.kv.get_computed_blocks(request)
                if self.evictor is not None:  # a hit and the first chunk must fit the request's KV budget
                    hit_blocks, hit_tokens = self.evictor.fit_hit(request, hit_blocks, hit_tokens)
            num_new = budget.grant(request, request.num_tokens - handed_over - hit_tokens, admitting=True)
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
            if slots is not None:
                slots.admitted(request)
            self._emit(request, num_new, new_blocks, out)
            budget.spend(num_new, admitted=request)

    def _speculate(self, budget: TokenBudget, out: SchedulerOutput) -> None:
        """Give this step's decodes the proposed tokens the speculator chooses, from the budget and the free
        blocks that the step left (speculation never preempts or delays anyone's prompt)."""
        cached = {data.request_id: data for data in out.scheduled_cached_reqs}
        for rid, tokens in self.speculator.propose(out, self.requests, budget.left).items():
            k = min(len(tokens), budget.left)
            if k <= 0:
                break
            new_blocks = self.kv.allocate_slots(self.requests[rid], 1, num_lookahead_tokens=k)
            if new_blocks is None:
                continue  # no free block for the proposals: it decodes one token, as without speculation
            cached[rid].new_block_ids.extend(new_blocks)
            out.scheduled_spec_tokens[rid] = tokens[:k]
            out.num_scheduled_tokens[rid] += k
            out.total_num_scheduled_tokens += k
            budget.spend(k)

    def _evict(self, request: Request, num_new: int) -> None:
        """Give back the blocks the eviction policy drops before ``num_new`` more tokens are allocated."""
        rid = request.request_id
        indices = self.evictor.choose(request, self.kv.blocks_of(rid), num_new)
        if indices:
            assert rid not in self._evicted, "evicted twice in one step"
            self.kv.evict_blocks(request, indices)
            self.evictor.on_evicted(rid, indices)
            self._evicted[rid] = indices

    def _release_kv(self, request: Request) -> bool:
        """Free a request's blocks (retired, or preempted: sent whole and recomputed exactly later): nothing it gave
        back is news to the executor, and eviction's scores of it are void. Whether the executor knew it (it is
        told to forget it)."""
        self.kv.free(request)
        self._kept_blocks.pop(request.request_id, None)
        if self.evictor is not None:
            self.evictor.forget(request.request_id)
            self._evicted.pop(request.request_id, None)
        if request.request_id not in self._seen_by_executor:
            return False
        self._seen_by_executor.discard(request.request_id)
        return True

    def _emit(self, request: Request, num_new: int, new_blocks: list[int], out: SchedulerOutput) -> None:
        rid = request.request_id
        if self.evictor is not None and (rows := self.evictor.score_rows(request, num_new)):
            out.kv_score_rows[rid] = rows
        if rid in self._seen_by_executor:
            out.scheduled_cached_reqs.append(CachedRequestData(
                rid, new_blocks, request.num_computed_tokens, self._kept_blocks.pop(rid, None),
                self._evicted.pop(rid, None), request.num_evicted_tokens, self.kv.num_skipped_blocks(rid)))
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
        if self._release_kv(request):
            out.preempted_req_ids.add(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, sched_out: SchedulerOutput, model_out: ModelOutput, now: float) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, apply the policy's decision on finished requests."""
        updates: list[RequestUpdate] = []
        self.step_cost.step_ended(sched_out, now)
        if self.evictor is not None:  # before the advance below: the scores are of the step's KV slots
            self.evictor.add_step_scores(self.requests, sched_out, model_out.kv_block_scores)
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
                updates.append(RequestUpdate.of(request, token, model_out.logprobs.get(rid), stop))
                if stop is not None:
                    break  # tokens accepted past a stop are nobody's
        return updates

    def drop_cut_step(self, out: SchedulerOutput) -> None:
        """The step ``out`` was cut short before its tokens were sampled (``core.policies.step_cut.cut_unsafe_reason`` allowed it): it
        is dropped as if it never ran. Counts are untouched (``update`` is not called for it), the requests keep
        their blocks and are scheduled again, and no block the step made findable stays findable."""
        self.kv.unpublish_step()

    def _finish_pooled(self, request: Request, pooled: list[float] | None, now: float) -> RequestUpdate:
        """A prefill-only request's prompt is computed: it finishes now with its pooled result and frees its
        blocks (every policy retires it: a padded baseline's slot has nothing left to decode)."""
        request.times.first_token = request.times.last_token = now
        stop = StopDecision(RequestStatus.FINISHED_STOPPED)
        request.mark_finished(stop.status, now)
        self.running.remove(request)
        self._retire(request)
        return RequestUpdate.of(request, -1, None, stop, pooled)

    def _verified(self, request: Request, proposed: int, accepted: int) -> None:
        """Roll a request back past its rejected proposals: their KV is not its tokens' (the slots after
        ``num_computed_tokens`` are rewritten by the next step), and the blocks only they used go back."""
        request.num_computed_tokens -= proposed - accepted
        kept = self.kv.trim(request, request.num_computed_tokens + 1)
        if kept is not None:
            self._kept_blocks[request.request_id] = kept
        self.speculator.verified(request.request_id, proposed, accepted)

    def check_invariants(self) -> None:
        """The KV manager's invariants, the policy objects' and the scheduler's own (``core.invariants``)."""
        check_scheduler(self)
