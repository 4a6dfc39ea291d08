"""Pure-Python scheduling core: requests, KV block bookkeeping, scheduler, policies. Imports no torch."""

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.interfaces import Executor, KVManager
from conveyor.core.outputs import ModelOutput, RequestUpdate, SchedulerOutput, SchedulerStats, TokenLogprobs
from conveyor.core.policies import POLICIES, SchedulingPolicy
from conveyor.core.request import Request, RequestStatus
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler

__all__ = [
    "CacheConfig",
    "Executor",
    "KVManager",
    "ModelOutput",
    "POLICIES",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "TokenLogprobs",
]
