"""Pure-Python scheduling core: requests, KV block bookkeeping, scheduler, policies. Imports no torch."""

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.outputs import CachedRequestData, ModelOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from conveyor.core.request import Request, RequestStatus
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import RequestUpdate, Scheduler

__all__ = [
    "CacheConfig",
    "CachedRequestData",
    "ModelOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "TokenLogprobs",
]
