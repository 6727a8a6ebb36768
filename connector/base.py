"""The core's own interface: what a single-process engine calls, in step order.

An :class:`OffloadCore` holds both roles of the offloading core in one object: the
scheduler side (the offload manager: which chunks the CPU tier holds, which copies to
plan, the reference-counted events) and the worker side (the CPU pool and the copies).
The simulated engine in :mod:`kvevents.sim` drives it directly; vLLM, which runs the
roles in two processes and has its own method names, loads the roles through
:mod:`connector.vllm`, the one adapter. Per engine step::

    scheduler side                                     worker side
    match_offloaded(req, n_computed) -> n_tokens       (admitting a request)
    on_blocks_allocated(req, blocks, n_load)           (admitting a request)
    plan_step(schedule) -> transfers  ──────────────►  start_loads(transfers)   before forward
                                                       ... forward pass writes the KV ...
                                                       submit_stores(transfers) after forward
    on_worker_report(report)  ◄──────────────────────  collect(newly_delayed) -> report
    on_request_finished(req, blocks) -> keep_blocks    (a request finished)
    take_events() -> wire events                       (drained once per step)

``attach_kv_caches`` is called once, before the first step. Loads are always
asynchronous: a request whose prefix ``match_offloaded`` found waits until it appears
in ``report.loaded``. ``on_request_finished`` returning True means stores still read the
request's blocks: the engine keeps them, passes the id to the next ``collect`` (as
newly delayed) and frees them once the id appears in ``report.releasable``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from kvevents.wire.schema import Event

from connector.step import RequestView, StepSchedule, StepTransfers, WorkerReport


class OffloadCore(ABC):
    """Both roles of an offloading core; every method runs on the engine's step thread."""

    # -- scheduler side --------------------------------------------------------
    @abstractmethod
    def match_offloaded(self, request: RequestView, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the CPU tier holds and can load (0: none)."""

    @abstractmethod
    def on_blocks_allocated(self, request: RequestView, block_ids: Sequence[int], num_load_tokens: int) -> None:
        """The engine gave ``request`` its blocks; plan a load of ``num_load_tokens`` into them."""

    @abstractmethod
    def plan_step(self, schedule: StepSchedule) -> StepTransfers:
        """This step's loads (planned at allocation) and stores (chunks the step completes)."""

    @abstractmethod
    def on_worker_report(self, report: WorkerReport) -> None:
        """Complete finished jobs: stored chunks become loadable, failed ones roll back."""

    @abstractmethod
    def on_request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        """Forget ``request``; True when its blocks must be kept until ``releasable``."""

    @abstractmethod
    def take_events(self) -> list[Event]:
        """Drain the wire events (CPU tier, reference-counted) produced since the last call."""

    # -- worker side -----------------------------------------------------------
    @abstractmethod
    def attach_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Once: the engine's per-layer KV tensors, block id on dim 0 (not owned)."""

    @abstractmethod
    def start_loads(self, transfers: StepTransfers) -> None:
        """Submit the step's loads; never waits for them."""

    @abstractmethod
    def submit_stores(self, transfers: StepTransfers) -> None:
        """Submit the step's stores after the forward pass; never waits for them."""

    @abstractmethod
    def collect(self, newly_delayed: set[str]) -> WorkerReport:
        """Jobs completed since the last call, and delayed requests now releasable."""

    # -- engine-level helpers --------------------------------------------------
    def wait_for_transfers(self, timeout: float | None = None) -> bool:
        """Block until in-flight copies are done (idle engine, tests, shutdown)."""
        return True

    def has_pending_transfers(self) -> bool:
        return False

    def reset_cache(self) -> bool:
        """Drop the offloaded tier (engine prefix-cache reset); False if busy."""
        return True

    def cached_block_hashes(self) -> dict[str, set[int]]:
        """Engine block hashes truly resident per tier ("CPU") held by this core."""
        return {}

    def stats(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        return None
