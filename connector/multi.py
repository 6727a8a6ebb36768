"""MultiConnector: several offloading cores behind one :class:`OffloadCore`.

Loads come from the first child whose tier holds a prefix of the request; stores go to
every child; reports and events are merged. A delayed request is reported
``releasable`` once every child has reported it (each child reports a request it was
told about exactly once, immediately when it had no stores in flight).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvevents.wire.schema import Event

from connector.base import OffloadCore
from connector.step import RequestView, StepSchedule, StepTransfers, WorkerReport


class MultiConnector(OffloadCore):
    """Fans one engine's calls out to ``children`` (at least one), in child order."""

    def __init__(self, children: Sequence[OffloadCore]) -> None:
        if not children:
            raise ValueError("MultiConnector needs at least one child")
        self.children = list(children)
        self._load_child: dict[str, int] = {}
        self._releasable_seen: dict[str, set[int]] = {}

    # scheduler side
    def match_offloaded(self, request: RequestView, num_computed_tokens: int) -> int:
        for i, child in enumerate(self.children):
            n = child.match_offloaded(request, num_computed_tokens)
            if n > 0:
                self._load_child[request.request_id] = i
                return n
        self._load_child.pop(request.request_id, None)
        return 0

    def on_blocks_allocated(self, request: RequestView, block_ids: Sequence[int], num_load_tokens: int) -> None:
        chosen = self._load_child.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            child.on_blocks_allocated(request, block_ids, num_load_tokens if i == chosen else 0)

    def plan_step(self, schedule: StepSchedule) -> StepTransfers:
        return StepTransfers(children=[c.plan_step(schedule) for c in self.children])

    def on_worker_report(self, report: WorkerReport) -> None:
        for child, child_report in zip(self.children, report.children or []):
            child.on_worker_report(child_report)

    def on_request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        # Every child must see the end of the request, so no short-circuit.
        keep = [child.on_request_finished(request, block_ids) for child in self.children]
        return any(keep)

    def take_events(self) -> list[Event]:
        return [ev for child in self.children for ev in child.take_events()]

    # worker side
    def attach_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for child in self.children:
            child.attach_kv_caches(kv_caches)

    def _child_transfers(self, transfers: StepTransfers) -> list[StepTransfers]:
        if transfers.children is None or len(transfers.children) != len(self.children):
            raise ValueError("MultiConnector needs the transfers its own plan_step returned")
        return transfers.children

    def start_loads(self, transfers: StepTransfers) -> None:
        for child, t in zip(self.children, self._child_transfers(transfers)):
            child.start_loads(t)

    def submit_stores(self, transfers: StepTransfers) -> None:
        for child, t in zip(self.children, self._child_transfers(transfers)):
            child.submit_stores(t)

    def collect(self, newly_delayed: set[str]) -> WorkerReport:
        reports = [child.collect(newly_delayed) for child in self.children]
        merged = WorkerReport(children=reports)
        for i, rep in enumerate(reports):
            merged.loaded |= rep.loaded
            merged.load_failed |= rep.load_failed
            merged.results.extend(rep.results)
            for req_id in rep.releasable:
                self._releasable_seen.setdefault(req_id, set()).add(i)
        for req_id in [r for r, seen in self._releasable_seen.items() if len(seen) == len(self.children)]:
            del self._releasable_seen[req_id]
            merged.releasable.add(req_id)
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
            for tier, hashes in child.cached_block_hashes().items():
                out.setdefault(tier, set()).update(hashes)
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
