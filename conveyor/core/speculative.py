"""Speculative decoding's scheduler side: the n-gram (prompt lookup) proposer and the per-step choice of how many
proposed tokens each request verifies.

A request that speculates is scheduled ``1 + k`` tokens: its last sampled token and ``k`` proposed ones. The
executor computes all of them in the step's one forward pass (as a prompt chunk), keeps the longest run of
proposals that the model itself would have produced, and returns those plus the token it sampled after them.
The scheduler then rolls the computed count back past the rejected proposals and gives their blocks back.

A proposal is verified by drawing each of its rows' tokens as the request draws any token and keeping the
proposals that equal the token drawn before them (``ModelRunner._verify``): for greedy requests exact match, so
the output is token-identical to decoding without speculation; for sampled ones rejection sampling of a fixed
proposal, so the distribution is unchanged. Requests whose draws depend on more than the logits (penalties,
bans, biases, grammars, logprobs, min_tokens still due) or that are seeded decode one token per step as before.

How many: a step's time grows with the tokens in it, by a fixed part and a part per token, both fitted online
from the steps this scheduler ran near the step's size (``StepCostModel``); a proposal's ``i``-th token is accepted with probability
``alpha ** i`` where ``alpha`` is the request's observed acceptance rate (``AcceptanceRate``). Adding one more
proposed token to the step buys its expected tokens ``g`` for ``c`` more seconds (the per-token cost), so it raises
the step's expected output tokens per second ``U / T`` exactly when ``g > c * U / T``. Tokens are added, best
first, while that holds (``choose_lengths``). On a small batch the fixed cost dominates ``T`` and every plausible
proposal pays; on a full step ``c * U / T`` nears one token and none does, which is the load-adaptive behaviour a
fixed ``k`` lacks.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.core.linalg import least_squares

if TYPE_CHECKING:
    from conveyor.core.outputs import SchedulerOutput

SPEC_METHODS = ("ngram", "draft_model")
# What the scheduler sends for each proposed token of a draft-model request: the executor runs the draft model
# in the step and puts its tokens in their place (the scheduler needs only how many).
DRAFT_PLACEHOLDER = -1


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` keys that apply here. ``method`` "ngram" proposes by prompt lookup (in the
    scheduler), "draft_model" by ``model``'s greedy tokens (in the executor; a ``model`` without a ``method``
    means it, as in vLLM). ``adaptive`` (conveyor's): choose each step's lengths by the cost rule above, up to
    ``num_speculative_tokens``; False: always propose that many."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    adaptive: bool = True
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of {SPEC_METHODS}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": the draft model to load')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'speculative_config: "model" is the draft model of method "draft_model", not of '
                             f'{self.method!r}')
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From what a user passes: a JSON object (the CLI), a dict (``LLM(speculative_config=...)``) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = set(value) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}")
        if value.get("model") is not None and "method" not in value:
            value = {**value, "method": "draft_model"}
        return cls(**value)

    @property
    def proposes_in_executor(self) -> bool:
        """Whether the executor makes the proposals (a draft model): the scheduler sends placeholders."""
        return self.method == "draft_model"


def speculates(params, num_output_tokens: int) -> bool:
    """Whether a request with these ``SamplingParams`` may speculate now (see the module docstring): its tokens
    are drawn from the logits by temperature, top-k, top-p and min-p alone, and it is not seeded (a seeded
    request draws the same tokens whatever else is in the batch; a proposal's rows would use its generator as
    many more times as the step's lengths, which depend on the load)."""
    return (params.seed is None and params.logprobs is None and not params.has_penalties
            and not params.has_logit_edits and params.structured_outputs is None and params.pooling is None
            and num_output_tokens >= params.min_tokens)


class NgramIndex:
    """Prompt lookup over one request's tokens: for each n-gram length, where each n-gram last ended.

    ``propose`` finds the longest suffix (``max_n`` down to ``min_n`` tokens) that occurred earlier and returns the
    tokens that followed its most recent earlier occurrence. The index grows by one entry per length per token
    (``extend``), so a step costs O(max_n) per request, not a scan of the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n -> {n-gram: end (exclusive) of its latest occurrence that is not the current suffix}
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the indexed sequence."""
        seq = self.tokens
        for token in tokens:
            end = len(seq)  # n-grams ending here are no longer the suffix once ``token`` follows them
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(seq[end - n:end])] = end
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier match of the current suffix ([] when none)."""
        seq = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(seq) <= n:
                continue
            end = self._ends[n].get(tuple(seq[-n:]))
            if end is not None:
                return seq[end:end + k]
        return []


class AcceptanceRate:
    """A per-token acceptance rate, from verified proposals: each proposal of ``k`` tokens with ``a`` accepted is
    ``a`` acceptances and, when ``a < k``, one rejection (the maximum-likelihood estimate of a geometric
    acceptance). A request's estimate starts from a prior worth ``prior_weight`` proposals: the scheduler's rate
    over every request (what this traffic's text is like), so one early miss does not silence it. It forgets old
    proposals (``DECAY`` per proposal, about the last 20 weigh), because a request that copied a passage and then
    writes its own text changes rate midway."""

    PRIOR_ALPHA = 0.5
    DECAY = 0.95
    # A rate only moves when the request verifies, and a low one stops it verifying: after this many steps
    # without, it probes with one token (when the step could afford a request of the prior's rate), so a
    # request whose text turned copyable is found again.
    PROBE_AFTER_STEPS = 16

    def __init__(self, prior_alpha: float = PRIOR_ALPHA, prior_weight: float = 2.0) -> None:
        self.accepted = prior_alpha * prior_weight
        self.rejected = (1.0 - prior_alpha) * prior_weight
        self.steps_without = 0

    def observe(self, proposed: int, accepted: int) -> None:
        self.accepted = self.DECAY * self.accepted + accepted
        self.rejected = self.DECAY * self.rejected + (accepted < proposed)
        self.steps_without = 0

    def due_for_probe(self) -> bool:
        """Count a step this request did not verify in; True when it is time to try one token again."""
        self.steps_without += 1
        return self.steps_without >= self.PROBE_AFTER_STEPS

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class StepCostModel:
    """Step time as ``fixed + per_token * tokens + chunk * [the step computes a multi-token row]``, a least-squares
    fit over the last ``window`` steps (the times come from the scheduler's caller: the real clock in the engine,
    the cost model's in the simulator). ``chunk`` is there because a step with a multi-token row (a prompt chunk,
    or a proposal being verified) takes another path through the attention and the layer stack, with a fixed cost
    of its own: a line through decode-only and verifying steps alone would charge that jump to every token."""

    # A fit is reused until this many steps more were observed (per size bound): the window moves by a few
    # percent meanwhile, and the fit (pure Python least squares over the window) was most of the scheduler's
    # speculation work per step.
    REFIT_AFTER = 4

    def __init__(self, window: int = 64) -> None:
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._observed = 0
        self._fits: dict[int | None, tuple[int, tuple[float, float, float]]] = {}
        self._step_start = 0.0

    def step_started(self, now: float) -> None:
        """A step was scheduled at ``now``."""
        self._step_start = now

    def step_ended(self, out: SchedulerOutput, now: float) -> None:
        """The step ``out``, started last, ended at ``now``: its time is a sample."""
        self.observe(out.total_num_scheduled_tokens, now - self._step_start,
                     any(n > 1 for n in out.num_scheduled_tokens.values()))

    def observe(self, num_tokens: int, seconds: float, has_chunk: bool = False) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, int(has_chunk), seconds))
            self._observed += 1

    def fit(self, up_to: int | None = None) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per token, chunk seconds) over the steps of at most ``up_to`` tokens (all:
        None; rounded up to a power of two), or None until those span more than one size. A step's cost is not
        linear over its whole range (a few tokens more cost little while the weights' reads dominate, a long
        prompt chunk is compute-bound), so a decision about a few more tokens fits the steps near its own size.
        ``chunk`` is 0 unless both kinds of step were seen."""
        if up_to is not None:
            up_to = 1 << max(up_to - 1, 0).bit_length()
        cached = self._fits.get(up_to)
        if cached is not None and self._observed - cached[0] < self.REFIT_AFTER:
            return cached[1]
        fitted = self._fit(up_to)
        if fitted is not None:
            self._fits[up_to] = (self._observed, fitted)
        return fitted

    def _fit(self, up_to: int | None) -> tuple[float, float, float] | None:
        samples = [s for s in self.samples if up_to is None or s[0] <= up_to]
        if len({x for x, _, _ in samples}) < 2:
            return None
        if len({m for _, m, _ in samples}) == 2:
            solved = least_squares([(1.0, x, m) for x, m, _ in samples], [y for _, _, y in samples])
            if solved is not None:
                fixed, slope, chunk = solved
                return max(fixed, 0.0), max(slope, 0.0), max(chunk, 0.0)
        n = len(samples)
        mx = sum(x for x, _, _ in samples) / n
        my = sum(y for _, _, y in samples) / n
        sxx = sum((x - mx) ** 2 for x, _, _ in samples)
        slope = max(sum((x - mx) * (y - my) for x, _, y in samples) / sxx, 0.0)
        return max(my - slope * mx, 0.0), slope, 0.0


def choose_lengths(proposals: dict[str, int], alphas: dict[str, float], step_tokens: int, useful_tokens: float,
                   cost: tuple[float, ...] | None, budget: int, has_chunk: bool = True) -> dict[str, int]:
    """How many proposed tokens each request verifies this step (request id -> k; requests with 0 left out).

    ``proposals``: the most each could verify (its proposal's length); ``step_tokens``: the tokens the step
    already computes; ``useful_tokens``: the output tokens it already yields (one per decode); ``cost``: the
    fitted (fixed, per-token[, chunk]) step time, None while unknown (then each verifies one token, which is how
    the fit learns a per-token cost); ``budget``: token budget left; ``has_chunk``: whether the step already has a
    multi-token row (else the first proposal also pays the chunk cost). The rule is the module docstring's; the
    next token of each request is worth ``alpha ** (k + 1)``, so a heap hands them out best first. The chunk cost
    is paid once, so it is judged on the whole choice: speculate only if the choice beats none with it."""
    if cost is None:
        return {rid: 1 for rid in list(proposals)[:budget]}
    fixed, per_token = cost[0], cost[1]
    chunk_cost = cost[2] if len(cost) > 2 else 0.0
    time_s = fixed + per_token * step_tokens + (chunk_cost if has_chunk else 0.0)
    chunk = 0.0 if has_chunk else chunk_cost  # what the first proposal adds to this step
    base_rate = useful_tokens / time_s
    lengths: dict[str, int] = {}
    heap = [(-alphas[rid], rid) for rid in proposals]
    heapq.heapify(heap)
    while heap and budget > 0:
        neg_gain, rid = heap[0]
        if -neg_gain * time_s <= per_token * useful_tokens:
            break  # the best token left costs more than it is expected to give; the rest are worse
        k = lengths[rid] = lengths.get(rid, 0) + 1
        useful_tokens -= neg_gain
        time_s += per_token
        budget -= 1
        if k < proposals[rid]:
            heapq.heapreplace(heap, (neg_gain * alphas[rid], rid))
        else:
            heapq.heappop(heap)
    if chunk and lengths and useful_tokens / (time_s + chunk) <= base_rate:
        return {}
    return lengths


def worth_proposing(alpha: float, step_tokens: int, useful_tokens: float, cost: tuple[float, ...] | None) -> bool:
    """Whether a request with acceptance rate ``alpha`` could get even one proposed token this step (so whether
    looking up its proposal is worth the time): ``choose_lengths``'s test for its first token, before any chunk
    cost (which the whole choice may still pay back)."""
    if cost is None:
        return True
    fixed, per_token = cost[0], cost[1]
    return alpha * (fixed + per_token * step_tokens) > per_token * useful_tokens


@dataclass
class SpecDecodeCounters:
    """Cumulative counts, as vLLM's ``spec_decode`` metrics: proposals verified, tokens proposed (verified),
    tokens accepted, and accepted tokens by position in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if self.accepted_per_pos is None:
            self.accepted_per_pos = []
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
