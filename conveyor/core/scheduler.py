"""The scheduler: re-decides the batch at every step (iteration-level scheduling).

Mechanism lives here (the token budget, the KV manager, preemption); decisions live in the policy object.
``schedule(now)`` grants each chosen request ``num_new_tokens`` so that its ``num_computed_tokens`` catches up
with ``num_tokens``; ``update(...)`` appends the sampled tokens and retires finished requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from conveyor.core.config import SchedulerConfig
from conveyor.core.outputs import (
    CachedRequestData,
    ModelOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from conveyor.core.policy import make_policy
from conveyor.core.request import Request, RequestStatus


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: the token it produced (if any) and whether it finished."""

    request_id: str
    new_token_id: int | None
    logprobs: TokenLogprobs | None
    finished: bool
    finish_reason: str | None = None


class Scheduler:
    """Owns the waiting queue and running batch; talks to a KV manager, never to the model."""

    def __init__(self, config: SchedulerConfig, kv_manager, policy=None) -> None:
        self.config = config
        self.kv = kv_manager
        self.policy = policy or make_policy(config)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the tail is the newest
        self._finished_ids: set[str] = set()  # to tell the executor at the next schedule()
        self._seen_by_executor: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0

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
        """Retire a request from outside the step (abort, stop string): its blocks are freed now."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._retire(request, status, now)

    def release_slot(self, request: Request) -> None:
        """Free a parked (finished, ``idle_slot``) request's slot and blocks; its finish time stays as it was."""
        assert request.idle_slot and request.is_finished, f"{request.request_id} is not a parked slot"
        self.running.remove(request)
        self._retire(request, request.status, request.times.finished)

    def _retire(self, request: Request, status: RequestStatus, now: float) -> None:
        request.status = status
        request.times.finished = now
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._seen_by_executor:
            self._seen_by_executor.discard(request.request_id)
            self._finished_ids.add(request.request_id)

    # ---- one step ---------------------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self.policy.begin_step(self, now)  # static/dynamic: release the parked slots of a drained batch
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.policy.step_budget()
        scheduled: set[str] = set()
        preempted_any = False

        # 1. Running requests: decodes first, then unfinished prompt chunks (stall-free chunked prefill).
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget <= 0:
                break
            if not self._holds_slot(request):
                continue  # preempted (or a parked slot released) earlier in this loop
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = 1 if remaining == 1 else self.policy.prefill_chunk(remaining, budget)
            if num_new == 0:
                continue
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
            budget -= num_new

        # 2. Waiting requests join, unless this step preempted (admitting now would only thrash).
        if not preempted_any:
            budget = self._admit(budget, now, out)

        self.policy.end_step(self, out)  # static/dynamic: pad the batch's prompts to the longest
        self.num_steps += 1
        return out

    def _admit(self, budget: int, now: float, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if not self.policy.may_admit(self.waiting, self.running, now):
                break
            request = self.waiting[0]
            hit_blocks, hit_tokens = ([], 0)
            if request.num_computed_tokens == 0:
                hit_blocks, hit_tokens = self.kv.get_computed_blocks(request)
            num_new = self.policy.prefill_chunk(request.num_tokens - hit_tokens, budget)
            if num_new == 0:
                break
            new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                break  # FCFS: the head of the queue waits for room; nobody jumps it
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = hit_tokens
            request.num_computed_tokens = hit_tokens
            request.status = RequestStatus.RUNNING
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
            self.running.append(request)
            self._emit(request, num_new, new_blocks, out)
            budget -= num_new
        return budget

    def _emit(self, request: Request, num_new: int, new_blocks: list[int], out: SchedulerOutput) -> None:
        rid = request.request_id
        if rid in self._seen_by_executor:
            out.scheduled_cached_reqs.append(CachedRequestData(rid, new_blocks, request.num_computed_tokens))
        else:
            self._seen_by_executor.add(rid)
            out.scheduled_new_reqs.append(
                NewRequestData(
                    request_id=rid,
                    token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv.block_ids(rid),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
        out.num_scheduled_tokens[rid] = num_new
        out.total_num_scheduled_tokens += num_new
        if request.idle_slot:
            out.num_idle_slot_tokens += num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the request's KV; it resumes later with prompt + outputs so far."""
        if request.idle_slot:  # a parked slot has nothing left to compute for anyone: release it instead
            self.release_slot(request)
            return
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if request.request_id in self._seen_by_executor:
            self._seen_by_executor.discard(request.request_id)
            out.preempted_req_ids.add(request.request_id)

    def update(self, sched_out: SchedulerOutput, model_out: ModelOutput, now: float) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, retire finished requests."""
        updates: list[RequestUpdate] = []
        sampled = model_out.sampled_token_ids
        for rid, num_new in sched_out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or not self._holds_slot(request):
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new
            token = sampled.get(rid)
            if token is None:
                continue  # mid-prefill
            if request.idle_slot:
                self._extend_idle_slot(request, token)
                continue
            request.output_token_ids.append(token)
            if request.times.first_token is None:
                request.times.first_token = now
            request.times.last_token = now
            status = request.check_stop(token)
            if status is not None:
                self._on_finished(request, status, now)
            updates.append(
                RequestUpdate(rid, token, model_out.logprobs.get(rid), status is not None, request.status.finish_reason)
            )
        return updates

    def _holds_slot(self, request: Request) -> bool:
        """Running, or finished but parked in its slot by a static/dynamic batch (and not released yet)."""
        if request.request_id not in self.requests:
            return False
        return request.status is RequestStatus.RUNNING or request.idle_slot

    @staticmethod
    def _extend_idle_slot(request: Request, token: int) -> None:
        """A static batch's finished slot keeps decoding: the token was computed for real and is discarded.

        It still extends the request's internal token list, so the KV bookkeeping (block count, block hashes)
        matches what the executor wrote; the user's output was frozen when the request finished. At
        max_model_len the slot stops computing (as a padded batch's row would) but stays held.
        """
        if request.max_model_len is None or request.num_tokens < request.max_model_len:
            request.output_token_ids.append(token)

    def _on_finished(self, request: Request, status: RequestStatus, now: float) -> None:
        if self.policy.holds_finished_slots:
            self.policy.park_finished(self, request, status, now)
            return
        self.running.remove(request)
        self._retire(request, status, now)

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
            assert request.num_computed_tokens <= request.num_tokens
