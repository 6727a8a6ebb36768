"""MultiConnector: several connectors behind one (vLLM's ``MultiConnector`` semantics).

Loads come from the first child that reports matched tokens for a request; stores go to
every child; finished sets and events are merged. A delayed request is reported in
``finished_sending`` once every child has reported it (each child reports a request it
was told about exactly once, immediately when it had no stores in flight).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvevents.schema import Event

from connector.base import KVConnector
from connector.metadata import ConnectorMetadata, KVConnectorOutput, RequestView, SchedulerOutput


@dataclass
class MultiConnectorMetadata(ConnectorMetadata):
    children: list[ConnectorMetadata] = field(default_factory=list)


class MultiConnector(KVConnector):
    def __init__(self, children: Sequence[KVConnector]) -> None:
        if not children:
            raise ValueError("MultiConnector needs at least one child")
        self.children = list(children)
        self._load_child: dict[str, int] = {}
        self._sending_seen: dict[str, set[int]] = {}

    # scheduler side
    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        for i, child in enumerate(self.children):
            n, is_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if n > 0:
                self._load_child[request.request_id] = i
                return n, is_async
        self._load_child.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int) -> None:
        chosen = self._load_child.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        return MultiConnectorMetadata(children=[c.build_connector_meta(scheduler_output) for c in self.children])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for child, child_out in zip(self.children, output.children or []):
            child.update_connector_output(child_out)

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        # Every child must see the end of the request, so no short-circuit.
        delays = [child.request_finished(request, block_ids) for child in self.children]
        return any(delays)

    def take_events(self) -> list[Event]:
        return [ev for child in self.children for ev in child.take_events()]

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self.children:
            child.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, MultiConnectorMetadata)
        for child, meta in zip(self.children, metadata.children):
            child.start_load_kv(meta)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        outs = [child.get_finished(finished_req_ids) for child in self.children]
        merged = KVConnectorOutput(children=outs)
        for i, out in enumerate(outs):
            merged.finished_recving |= out.finished_recving
            merged.failed_recving |= out.failed_recving
            merged.job_results.extend(out.job_results)
            for req_id in out.finished_sending:
                self._sending_seen.setdefault(req_id, set()).add(i)
        for req_id in [r for r, seen in self._sending_seen.items() if len(seen) == len(self.children)]:
            del self._sending_seen[req_id]
            merged.finished_sending.add(req_id)
        return merged

    # engine helpers
    def wait_for_transfers(self, timeout: float | None = None) -> bool:
        return all([c.wait_for_transfers(timeout) for c in self.children])

    def has_pending_transfers(self) -> bool:
        return any(c.has_pending_transfers() for c in self.children)

    def reset_cache(self) -> bool:
        if self.has_pending_transfers():
            return False
        return all([c.reset_cache() for c in self.children])

    def cached_block_hashes(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for child in self.children:
            for medium, hashes in child.cached_block_hashes().items():
                out.setdefault(medium, set()).update(hashes)
        return out

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for child in self.children:
            for k, v in child.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
