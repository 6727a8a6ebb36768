"""Continuous-batching scheduler: admits requests FCFS under a token budget per step.

Running requests are scheduled first (decodes and chunked-prefill continuations), then
waiting requests whose arrival time has come. A request is admitted only if the pool
can hold all blocks it may ever need beyond those reserved by running requests, so
no preemption is ever needed. On admission the GPU prefix cache is consulted, then the
offloading core (``match_offloaded``): a CPU-tier hit allocates the blocks, plans an
asynchronous load (``on_blocks_allocated``) and parks the request in
WAITING_FOR_REMOTE_KVS until the load is reported finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from connector.base import OffloadCore
from connector.step import ScheduledRequest, StepSchedule
from kvevents.sim.block_pool import BlockPool
from kvevents.sim.request import Request, RequestStatus


@dataclass
class StepPlan:
    schedule: StepSchedule
    num_prefill_tokens: int
    num_decode_reqs: int
    num_load_tokens: int


class Scheduler:
    def __init__(self, pool: BlockPool, connector: OffloadCore | None, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.pool = pool
        self.connector = connector
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        if request.blocks_needed() > self.pool.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs {request.blocks_needed()} blocks; the pool has {self.pool.num_blocks}"
            )
        self.waiting.append(request)

    def _outstanding(self) -> int:
        """Blocks running or loading requests may still allocate."""
        reqs = [*self.running, *self.loading.values()]
        return sum(r.blocks_needed() - len(r.block_ids) for r in reqs)

    def _grow(self, req: Request, num_tokens: int) -> None:
        need = -(-num_tokens // self.pool.block_size) - len(req.block_ids)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))

    def schedule(self, now: float) -> StepPlan:
        budget = self.max_num_batched_tokens
        out = StepSchedule()
        prefill = decode = loads = 0
        for req in self.running:
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            self._grow(req, req.num_computed_tokens + n)
            out.requests.append(ScheduledRequest(req, req.block_ids, req.num_computed_tokens, n))
            budget -= n
            if req.num_computed_tokens >= req.num_prompt_tokens:
                decode += 1
            else:
                prefill += n
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            req = self.waiting[0]
            if req.arrival_time > now:
                break
            hits = self.pool.get_computed_blocks(req)
            num_computed = len(hits) * self.pool.block_size
            ext = 0
            if self.connector is not None:
                ext = self.connector.match_offloaded(req, num_computed)
            hits_free = sum(1 for b in hits if self.pool._ref[b] == 0)
            if self.pool.num_free() - hits_free - self._outstanding() < req.blocks_needed() - len(hits):
                break  # FCFS: wait for blocks rather than starve the head of the queue
            self.waiting.popleft()
            self.pool.touch(hits)
            req.block_ids = list(hits)
            req.num_computed_tokens = num_computed
            req.num_cached_blocks = len(hits)
            req.num_gpu_cached_tokens = num_computed
            if ext > 0:
                self._grow(req, num_computed + ext)
                assert self.connector is not None
                self.connector.on_blocks_allocated(req, req.block_ids, ext)
                req.pending_external_tokens = ext
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading[req.request_id] = req
                loads += ext
                continue
            n = min(req.num_tokens - num_computed, budget)
            self._grow(req, num_computed + n)
            if self.connector is not None:
                self.connector.on_blocks_allocated(req, req.block_ids, 0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(ScheduledRequest(req, req.block_ids, num_computed, n))
            budget -= n
            prefill += n
        return StepPlan(out, prefill, decode, loads)

    def load_finished(self, req_id: str, success: bool) -> Request | None:
        """A CPU-tier load completed: the request becomes runnable."""
        req = self.loading.pop(req_id, None)
        if req is None:
            return None
        if success:
            req.num_computed_tokens += req.pending_external_tokens
            req.num_cpu_loaded_tokens = req.pending_external_tokens
        req.pending_external_tokens = 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)
