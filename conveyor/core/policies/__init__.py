"""Scheduling policies, by name: the one list of the names ``--policy`` accepts.

==============  =====================================================================================
``chunked``     continuous batching under a token budget, prompts in chunks (the default)
``continuous``  continuous batching, each prompt whole in the step it joins (Orca)
``static``      batches of ``max_num_seqs`` that run until their last member finishes (baseline)
``dynamic``     static, but a batch also starts after ``max_wait_ms`` (baseline)
==============  =====================================================================================
"""

from __future__ import annotations

from conveyor.core.config import SchedulerConfig
from conveyor.core.policies.base import NO_WASTE, BasePolicy, OnFinish, SchedulingPolicy, WastedWork
from conveyor.core.policies.baselines import DynamicBatchPolicy, StaticBatchPolicy
from conveyor.core.policies.continuous import ChunkedPolicy, ContinuousPolicy

POLICIES: dict[str, type[BasePolicy]] = {
    cls.name: cls for cls in (StaticBatchPolicy, DynamicBatchPolicy, ContinuousPolicy, ChunkedPolicy)
}


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy object named by ``config.policy``."""
    cls = POLICIES.get(config.policy)
    if cls is None:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {config.policy!r}")
    return cls(config)


__all__ = ["NO_WASTE", "POLICIES", "BasePolicy", "OnFinish", "SchedulingPolicy", "WastedWork", "make_policy"]
