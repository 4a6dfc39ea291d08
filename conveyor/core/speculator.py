"""``Speculator``: speculative decoding's decisions, as ``KVEvictor`` is KV eviction's (the scheduler holds one and
calls it at named points; ``core.speculative`` holds the pieces it is made of and the reasoning).

It owns speculation's state: each request's prompt-lookup index and acceptance rate, the traffic's rate (a new
request's prior) and the cumulative counters; it reads the scheduler's fit of the measured step cost (which
priority's step slack reads too). The scheduler keeps the mechanism:
the KV slots the proposals take (``KVManager.allocate_slots`` with lookahead) and give back after verification
(``KVManager.trim``), and the step contract (``SchedulerOutput.scheduled_spec_tokens``).

    schedule:  proposals = speculator.propose(out, requests, budget_left)   # then the scheduler allocates
    update:    speculator.verified(rid, proposed, accepted) per verifying request
    retire:    speculator.forget(rid)   (a preempted request keeps its index and rate: its tokens are the same)
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.core.outputs import SchedulerOutput
from conveyor.core.request import Request
from conveyor.core.speculative import (
    DRAFT_PLACEHOLDER,
    AcceptanceRate,
    NgramIndex,
    SpecDecodeCounters,
    SpeculativeConfig,
    StepCostModel,
    choose_lengths,
    speculates,
    worth_proposing,
)


class Speculator:
    """Which of a step's decodes verify proposed tokens, and which tokens (see ``core.speculative``)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int | None, cost: StepCostModel) -> None:
        """``cost``: the scheduler's fit of its measured steps (it observes every step; this reads it)."""
        self.config = config
        self.max_model_len = max_model_len
        self.cost = cost
        self.rate = AcceptanceRate()  # over every request: a new request's prior
        self.counters = SpecDecodeCounters()
        self.acceptance: dict[str, AcceptanceRate] = {}
        self.ngrams: dict[str, NgramIndex] = {}

    def propose(self, out: SchedulerOutput, requests: Mapping[str, Request], budget_left: int) -> dict[str, list[int]]:
        """Proposed tokens for this step's decodes that may speculate (request id -> tokens, best first), as many
        as the rule chooses from what the step already computes and ``budget_left`` tokens of budget; a draft
        model's are ``DRAFT_PLACEHOLDER``s. Speculation never preempts or delays anyone's prompt: the scheduler
        calls this last and allocates what it can."""
        if budget_left <= 0:
            return {}
        spec, adaptive = self.config, self.config.adaptive
        step_tokens = out.total_num_scheduled_tokens
        useful = sum(1 for rid, n in out.num_scheduled_tokens.items()
                     if requests[rid].num_computed_tokens + n >= requests[rid].num_tokens)
        # the step's cost around the sizes this decision can reach: up to every decode's full proposal, twice
        reach = 2 * (step_tokens + spec.num_speculative_tokens * useful)
        cost = self.cost.fit(up_to=reach) if adaptive else None
        proposals: dict[str, list[int]] = {}
        alphas: dict[str, float] = {}
        probes: set[str] = set()  # requests whose low rate is tried again with one token
        for data in out.scheduled_cached_reqs:
            rid = data.request_id
            request = requests[rid]
            if out.num_scheduled_tokens[rid] != 1 or request.num_computed_tokens + 1 != request.num_tokens or \
                    not speculates(request.sampling_params, request.num_output_tokens):
                continue
            rate = self.acceptance.get(rid)
            alpha = alphas[rid] = rate.alpha if rate is not None else self.rate.alpha
            if adaptive and not worth_proposing(alpha, step_tokens, useful, cost):
                affordable = worth_proposing(self.rate.alpha, step_tokens, useful, cost)
                if rate is None or not (rate.due_for_probe() and affordable):
                    continue  # not even its first token would pay: skip the lookup
                # tried as a request of the traffic's rate, one token, judged with the rest (so a probe that
                # would put the multi-token path's cost on a step of decodes waits for a step that has it)
                probes.add(rid)
                alphas[rid] = self.rate.alpha
            # beyond the token it always samples: what max_tokens and the context leave
            room = request.max_output_tokens() - request.num_output_tokens - 1
            if self.max_model_len is not None:
                room = min(room, self.max_model_len - request.num_tokens - 1)
            if room <= 0:
                continue
            most = min(spec.num_speculative_tokens, room)
            if spec.proposes_in_executor:  # the draft model fills them in, in the step
                proposals[rid] = [DRAFT_PLACEHOLDER] * most
            elif drafts := self._ngram_index(request).propose(most):
                proposals[rid] = drafts
        if not proposals or not adaptive:
            return proposals
        has_chunk = any(n > 1 for n in out.num_scheduled_tokens.values())
        lengths = choose_lengths({rid: 1 if rid in probes else len(d) for rid, d in proposals.items()}, alphas,
                                 step_tokens, useful, cost, budget_left, has_chunk)
        return {rid: proposals[rid][:k] for rid, k in lengths.items()}

    def verified(self, request_id: str, proposed: int, accepted: int) -> None:
        """A request verified ``proposed`` tokens and the model agreed with the first ``accepted``."""
        self.acceptance.setdefault(request_id, AcceptanceRate(self.rate.alpha)).observe(proposed, accepted)
        self.rate.observe(proposed, accepted)
        self.counters.record(proposed, accepted)

    def forget(self, request_id: str) -> None:
        """The request has left."""
        self.ngrams.pop(request_id, None)
        self.acceptance.pop(request_id, None)

    def _ngram_index(self, request: Request) -> NgramIndex:
        """The request's prompt-lookup index, brought up to its tokens so far."""
        index = self.ngrams.get(request.request_id)
        if index is None:
            index = self.ngrams[request.request_id] = NgramIndex(self.config.prompt_lookup_min,
                                                                 self.config.prompt_lookup_max)
            index.extend(request.prompt_token_ids)
        index.extend(request.output_token_ids[len(index.tokens) - request.num_prompt_tokens:])
        return index
