"""The offloading core's single-process adapter: both roles in one object.

The simulated engine in :mod:`kvevents.sim` is single-process, so one object holds both
roles, each delegating to the core class of its role. vLLM runs the roles in two
processes and loads them through :mod:`connector.vllm` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvevents.schema import MEDIUM_CPU, Event

from connector.base import KVConnector
from connector.config import OffloadConfig
from connector.kv_layout import KVCacheLayout
from connector.metadata import ConnectorMetadata, KVConnectorOutput, RequestView, SchedulerOutput
from connector.scheduler import OffloadingConnectorScheduler
from connector.worker import OffloadingConnectorWorker


class OffloadingConnector(KVConnector):
    """GPU <-> CPU offloading with self-describing, reference-counted CPU-tier events.

    Construction validates ``config`` against ``layout`` (raises ``ValueError``).
    ``shutdown()`` stops the transfer worker after its queued jobs.
    """

    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, medium: str = MEDIUM_CPU) -> None:
        self.config = config
        self.layout = layout
        self.scheduler = OffloadingConnectorScheduler(config, layout, medium)
        self.worker = OffloadingConnectorWorker(layout, self.scheduler.num_slots * self.scheduler.k)

    # scheduler side
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        return self.scheduler.request_finished(request, block_ids)

    def take_events(self) -> list[Event]:
        return self.scheduler.take_events()

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self.worker.start_load_kv(metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return self.worker.get_finished(finished_req_ids)

    # engine helpers
    def wait_for_transfers(self, timeout: float | None = None) -> bool:
        return self.worker.wait(timeout)

    def has_pending_transfers(self) -> bool:
        return self.scheduler.has_pending_jobs() or self.worker.pending() > 0

    def reset_cache(self) -> bool:
        return self.scheduler.reset()

    def cached_block_hashes(self) -> dict[str, set[int]]:
        return {self.scheduler.manager.medium: self.scheduler.cpu_block_hashes()}

    def stats(self) -> dict[str, float]:
        return dict(vars(self.scheduler.stats))

    def shutdown(self) -> None:
        self.worker.shutdown()
