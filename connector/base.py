"""The contract a single-process engine drives (the simulated engine in ``kvevents.sim``).

Both roles of the core in one object, called in engine-step order (vLLM itself loads
the core through :mod:`connector.vllm`, whose interface is vLLM's own). Per step::

    scheduler side                                 worker side
    get_num_new_matched_tokens(req, n_computed)    (new requests only)
    update_state_after_alloc(req, blocks, n_ext)
    build_connector_meta(sched_out) -> meta  ───►  start_load_kv(meta)    before forward
                                                   ... forward pass ...
                                                   wait_for_save()         after forward
    update_connector_output(out)   ◄───────────    get_finished(delayed_finished_ids) -> out
    request_finished(req, blocks) -> delay_free
    take_events() -> wire events

``request_finished`` returning True means blocks are still being read by stores: the
engine must keep them until the request id appears in ``finished_sending``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from kvevents.schema import Event

from connector.metadata import ConnectorMetadata, KVConnectorOutput, RequestView, SchedulerOutput


class KVConnector(ABC):
    # -- scheduler side --------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the connector can load, and whether async."""

    @abstractmethod
    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata: ...

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    @abstractmethod
    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool: ...

    @abstractmethod
    def take_events(self) -> list[Event]: ...

    # -- worker side -----------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None: ...

    @abstractmethod
    def wait_for_save(self) -> None: ...

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput: ...

    # -- engine-level helpers (not in vLLM's interface) ------------------------
    def wait_for_transfers(self, timeout: float | None = None) -> bool:
        """Block until in-flight copies are done (idle engine, tests, shutdown)."""
        return True

    def has_pending_transfers(self) -> bool:
        return False

    def reset_cache(self) -> bool:
        """Drop the offloaded tier (engine prefix-cache reset); False if busy."""
        return True

    def cached_block_hashes(self) -> dict[str, set[int]]:
        """True resident engine block hashes per medium held by this connector."""
        return {}

    def stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        return None
