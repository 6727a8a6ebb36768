"""Scheduler-side offload bookkeeping: interfaces, manager, eviction policies."""

from connector.offload.abstract import (
    BlockStatus,
    CPULoadStoreSpec,
    EvictionPolicy,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
)
from connector.offload.manager import POLICIES, CPUOffloadingManager

__all__ = [
    "BlockStatus",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "EvictionPolicy",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "POLICIES",
    "PrepareStoreOutput",
]
