"""Scheduling policies, by name: the one list of the names ``--policy`` accepts.

==============  =====================================================================================
``chunked``     continuous batching under a token budget, prompts in chunks (the default)
``continuous``  continuous batching, each prompt whole in the step it joins (Orca)
``static``      batches of ``max_num_seqs`` that run until their last member finishes (baseline)
``dynamic``     static, but a batch also starts after ``max_wait_ms`` (baseline)
==============  =====================================================================================

``SchedulerConfig.scheduling_policy`` "priority" serves continuous and chunked batching in priority order
(``priority.py``); "fcfs" in arrival order.
"""

from __future__ import annotations

from conveyor.core.config import SchedulerConfig
from conveyor.core.policies.base import (
    NO_WASTE, NO_YIELD, BasePolicy, OnFinish, Room, SchedulingPolicy, StepYield, WaitingQueue, WastedWork,
)
from conveyor.core.policies.baselines import DynamicBatchPolicy, StaticBatchPolicy
from conveyor.core.policies.continuous import ChunkedPolicy, ContinuousPolicy
from conveyor.core.policies.priority import BATCH_PRIORITY, WITH_PRIORITY

POLICIES: dict[str, type[BasePolicy]] = {
    cls.name: cls for cls in (StaticBatchPolicy, DynamicBatchPolicy, ContinuousPolicy, ChunkedPolicy)
}


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy object named by ``config.policy``, in the order ``config.scheduling_policy`` names."""
    cls = POLICIES.get(config.policy)
    if cls is None:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {config.policy!r}")
    if config.scheduling_policy == "priority":
        cls = WITH_PRIORITY[config.policy]
    return cls(config)


__all__ = ["BATCH_PRIORITY", "NO_WASTE", "NO_YIELD", "POLICIES", "BasePolicy", "OnFinish", "Room", "SchedulingPolicy",
           "StepYield", "WaitingQueue", "WastedWork", "make_policy"]
