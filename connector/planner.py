"""Scheduler side of the offloading core: plans what to load and store.

Owns the :class:`CPUOffloadingManager` and the :class:`OffloadEventsTracker`; never
touches tensors. It turns engine requests into offload keys (one per offloaded chunk of
k engine blocks, keyed by the chunk's last engine block hash), plans copies as
:class:`StepTransfers`, and completes them from the worker side's :class:`WorkerReport`.
Its methods are those of the scheduler side of :class:`connector.base.OffloadCore`, in
that order. Single-threaded: the engine's scheduler loop calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvevents.wire.schema import MEDIUM_CPU, Event

from connector.config import OffloadConfig
from connector.events_tracker import ChunkPayload, OffloadEventsTracker
from connector.kv_layout import KVCacheLayout
from connector.step import RequestView, StepSchedule, StepTransfers, TransferSpec, WorkerReport
from connector.offload.abstract import OffloadKey
from connector.offload.manager import CPUOffloadingManager
from connector.transfer.abstract import Direction


@dataclass
class _ReqState:
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # first chunk not yet considered for storing
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    lookup: tuple[int, int, int] | None = None  # (num_computed, start chunk, hits)


@dataclass
class _Job:
    req_id: str
    direction: Direction
    keys: tuple[OffloadKey, ...]


@dataclass
class OffloadStats:
    stored_bytes: int = 0
    stored_seconds: float = 0.0
    loaded_bytes: int = 0
    loaded_seconds: float = 0.0
    store_jobs: int = 0
    load_jobs: int = 0
    failed_jobs: int = 0
    stored_chunks: int = 0
    loaded_chunks: int = 0
    store_skipped_chunks: int = 0  # prepare_store could not allocate


class OffloadPlanner:
    """Scheduler side of one CPU tier (``tier`` names it in events, "CPU")."""

    def __init__(self, config: OffloadConfig, layout: KVCacheLayout, tier: str = MEDIUM_CPU) -> None:
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.k = config.blocks_per_chunk(layout.block_size)
        self.chunk_tokens = self.k * self.block_size
        self.num_slots = config.num_slots(layout.bytes_per_block * self.k)
        self.manager = CPUOffloadingManager(self.num_slots, self.chunk_tokens, config.eviction_policy, tier)
        self.tracker = OffloadEventsTracker(tier, config.self_describing_events)
        self.stats = OffloadStats()
        self._reqs: dict[str, _ReqState] = {}
        self._jobs: dict[int, _Job] = {}
        self._pending_loads: list[TransferSpec] = []
        self._next_job = 0

    def _keys(self, request: RequestView, start: int, stop: int) -> list[OffloadKey]:
        hashes = request.block_hashes
        stop = min(stop, len(hashes) // self.k)
        return [OffloadKey(hashes[(c + 1) * self.k - 1]) for c in range(start, stop)]

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def _rows(self, slots: Sequence[int]) -> np.ndarray:
        """CPU pool rows (engine-block granular) of the given slots, in order."""
        s = np.asarray(slots, dtype=np.int64)
        return (s[:, None] * self.k + np.arange(self.k, dtype=np.int64)).ravel()

    # -- loads -----------------------------------------------------------------

    def match_offloaded(self, request: RequestView, num_computed_tokens: int) -> int:
        # Never cover the last prompt token: the engine must compute at least one token
        # to produce the next one.
        num_chunks = (request.num_tokens - 1) // self.chunk_tokens
        start = num_computed_tokens // self.chunk_tokens
        if start >= num_chunks:
            return 0
        hits = self.manager.lookup(self._keys(request, start, num_chunks))
        if hits == 0:
            return 0
        state = self._reqs.setdefault(request.request_id, _ReqState())
        state.lookup = (num_computed_tokens, start, hits)
        return (start + hits) * self.chunk_tokens - num_computed_tokens

    def on_blocks_allocated(self, request: RequestView, block_ids: Sequence[int], num_load_tokens: int) -> None:
        state = self._reqs.setdefault(request.request_id, _ReqState())
        state.block_ids = list(block_ids)
        if num_load_tokens == 0 or state.lookup is None:
            return
        num_computed, start, hits = state.lookup
        state.lookup = None
        keys = self._keys(request, start, start + hits)
        spec = self.manager.prepare_load(keys)
        self.manager.touch(keys)
        first_block = num_computed // self.block_size
        end_block = (start + hits) * self.k
        # Skip the chunk's leading blocks the GPU prefix cache already had.
        rows = self._rows(spec.slots)[first_block - start * self.k :]
        gpu = np.asarray(state.block_ids[first_block:end_block], dtype=np.int64)
        job = self._job_id()
        self._jobs[job] = _Job(request.request_id, Direction.LOAD, tuple(keys))
        self._pending_loads.append(TransferSpec(job, request.request_id, rows, gpu))
        self.stats.loaded_chunks += len(keys)

    # -- stores ----------------------------------------------------------------

    def plan_step(self, schedule: StepSchedule) -> StepTransfers:
        plan = StepTransfers(loads=self._pending_loads)
        self._pending_loads = []
        for sr in schedule.requests:
            req = sr.request
            state = self._reqs.setdefault(req.request_id, _ReqState())
            state.block_ids = list(sr.block_ids)
            n_chunks = (sr.num_computed_tokens + sr.num_scheduled_tokens) // self.chunk_tokens
            if n_chunks <= state.next_chunk:
                continue
            first = state.next_chunk
            keys = self._keys(req, first, n_chunks)
            state.next_chunk = first + len(keys)
            if not keys:
                continue
            out = self.manager.prepare_store(keys)
            if out is None:
                self.stats.store_skipped_chunks += len(keys)
                continue
            self.manager.touch(keys)
            if not out.keys_to_store:
                continue
            index = {key: first + i for i, key in enumerate(keys)}
            chunks = [index[key] for key in out.keys_to_store]
            for key, c in zip(out.keys_to_store, chunks):
                self.tracker.snapshot(key, self._payload(req, c))
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            chunk_arr = np.asarray(chunks, dtype=np.int64)
            gpu = blocks[(chunk_arr[:, None] * self.k + np.arange(self.k)).ravel()]
            job = self._job_id()
            self._jobs[job] = _Job(req.request_id, Direction.STORE, out.keys_to_store)
            state.store_jobs.add(job)
            plan.stores.append(TransferSpec(job, req.request_id, gpu, self._rows(out.store_spec.slots)))
        return plan

    def _payload(self, req: RequestView, chunk: int) -> ChunkPayload:
        k, bs = self.k, self.block_size
        hashes = req.block_hashes
        return ChunkPayload(
            block_hashes=tuple(hashes[chunk * k : (chunk + 1) * k]),
            parent_block_hash=hashes[chunk * k - 1] if chunk > 0 else None,
            token_ids=tuple(req.all_token_ids[chunk * k * bs : (chunk + 1) * k * bs]),
            block_size=bs,
            lora_name=req.lora_name,
            extra_keys=(req.block_extra_keys,) * k,
        )

    # -- completion ------------------------------------------------------------

    def on_worker_report(self, report: WorkerReport) -> None:
        for res in report.results:
            job = self._jobs.pop(res.job_id, None)
            if job is None:
                continue
            if not res.success:
                self.stats.failed_jobs += 1
            if job.direction is Direction.STORE:
                self.manager.complete_store(job.keys, res.success)
                if not res.success:
                    self.tracker.discard(job.keys)
                else:
                    self.stats.stored_chunks += len(job.keys)
                self.stats.store_jobs += 1
                self.stats.stored_bytes += res.num_bytes
                self.stats.stored_seconds += res.seconds
                state = self._reqs.get(job.req_id)
                if state is not None:
                    state.store_jobs.discard(res.job_id)
            else:
                self.manager.complete_load(job.keys)
                self.stats.load_jobs += 1
                self.stats.loaded_bytes += res.num_bytes
                self.stats.loaded_seconds += res.seconds
        for req_id in report.releasable:
            state = self._reqs.get(req_id)
            if state is not None and state.finished:
                del self._reqs[req_id]

    def on_request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        state = self._reqs.get(request.request_id)
        if state is None:
            return False
        if state.store_jobs:
            state.finished = True
            return True
        del self._reqs[request.request_id]
        return False

    def take_events(self) -> list[Event]:
        return self.tracker.translate(self.manager.take_events())

    # -- engine helpers --------------------------------------------------------

    def has_pending_jobs(self) -> bool:
        return bool(self._jobs)

    def reset(self) -> bool:
        if self._jobs or self._pending_loads or not self.manager.reset():
            return False
        self.tracker.reset()
        return True

    def cpu_block_hashes(self) -> set[int]:
        out: set[int] = set()
        for key in self.manager.ready_keys():
            out.update(self.tracker.constituents(key))
        return out

    def has_pending_stores(self, req_id: str) -> bool:
        """Whether stores reading this request's blocks are still in flight."""
        state = self._reqs.get(req_id)
        return state is not None and bool(state.store_jobs)

    def has_pending_load(self, req_id: str) -> bool:
        """Whether a load into this request's blocks is issued and not yet completed."""
        return any(job.req_id == req_id and job.direction is Direction.LOAD for job in self._jobs.values())
