"""The offloading core for a single-process engine: both roles in one object.

The simulated engine in :mod:`kvevents.sim` is single-process, so one object holds both
roles, each delegating to the class of its role (:class:`OffloadPlanner`,
:class:`OffloadWorker`). vLLM runs the roles in two processes and loads them through
:mod:`connector.vllm` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvevents.wire.schema import MEDIUM_CPU, Event

from connector.base import OffloadCore
from connector.config import OffloadConfig
from connector.kv_layout import KVCacheLayout
from connector.planner import OffloadPlanner
from connector.step import RequestView, StepSchedule, StepTransfers, WorkerReport
from connector.worker import OffloadWorker


class CPUOffloadCore(OffloadCore):
    """GPU <-> CPU offloading with self-describing, reference-counted CPU-tier events.

    Construction validates ``config`` against ``layout`` (raises ``ValueError``).
    ``shutdown()`` stops the transfer worker after its queued jobs.
    """

    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, tier: str = MEDIUM_CPU) -> None:
        self.config = config
        self.layout = layout
        self.planner = OffloadPlanner(config, layout, tier)
        self.worker = OffloadWorker(layout, self.planner.num_slots * self.planner.k)

    # scheduler side
    def match_offloaded(self, request: RequestView, num_computed_tokens: int) -> int:
        return self.planner.match_offloaded(request, num_computed_tokens)

    def on_blocks_allocated(self, request: RequestView, block_ids: Sequence[int], num_load_tokens: int) -> None:
        self.planner.on_blocks_allocated(request, block_ids, num_load_tokens)

    def plan_step(self, schedule: StepSchedule) -> StepTransfers:
        return self.planner.plan_step(schedule)

    def on_worker_report(self, report: WorkerReport) -> None:
        self.planner.on_worker_report(report)

    def on_request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        return self.planner.on_request_finished(request, block_ids)

    def take_events(self) -> list[Event]:
        return self.planner.take_events()

    # worker side
    def attach_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.attach_kv_caches(kv_caches)

    def start_loads(self, transfers: StepTransfers) -> None:
        self.worker.start_loads(transfers)

    def submit_stores(self, transfers: StepTransfers) -> None:
        self.worker.submit_stores(transfers)

    def collect(self, newly_delayed: set[str]) -> WorkerReport:
        return self.worker.collect(newly_delayed)

    # engine helpers
    def wait_for_transfers(self, timeout: float | None = None) -> bool:
        return self.worker.wait(timeout)

    def has_pending_transfers(self) -> bool:
        return self.planner.has_pending_jobs() or self.worker.pending() > 0

    def reset_cache(self) -> bool:
        return self.planner.reset()

    def cached_block_hashes(self) -> dict[str, set[int]]:
        return {self.planner.manager.tier: self.planner.cpu_block_hashes()}

    def stats(self) -> dict[str, float]:
        return dict(vars(self.planner.stats))

    def shutdown(self) -> None:
        self.worker.shutdown()
