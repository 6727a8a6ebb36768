"""A small paged-KV inference engine that drives the connector core directly.

Lifecycle: construct (allocates the KV cache on ``cuda`` when available, else ``cpu``,
through :class:`connector.KVCacheLayout`; events still say "GPU"; attaches it to the
offloading core) -> ``add_request`` any time ->
``step()`` / ``run_until_idle()`` -> ``shutdown()`` (waits for in-flight copies and stops
the core's worker side; the publisher passed in stays the caller's to shut down).

Each step, in the order of :class:`connector.base.OffloadCore`: schedule -> ``plan_step``
-> ``start_loads`` -> forward (deterministic KV writes, :class:`connector.kv_pattern.KVPattern`)
-> ``submit_stores`` -> sample one token per request that reached the end of its tokens
(``on_request_finished`` for those done) -> ``collect`` / ``on_worker_report`` -> publish
one ``KVEventBatch`` with this step's GPU events followed by the core's (``take_events``).
This module never touches a tensor: it hands numpy index arrays to the connector side.
Time is simulated (:class:`TimeModel`): ``RequestResult.ttft`` is in simulated seconds,
whatever the host's speed.
"""

from __future__ import annotations

import time

import numpy as np

from kvevents.wire.publisher import EventPublisher, NullEventPublisher
from kvevents.wire.schema import MEDIUM_CPU, MEDIUM_GPU, Event, KVEventBatch

from connector.base import OffloadCore
from connector.config import OffloadConfig
from connector.core import CPUOffloadCore
from connector.kv_layout import default_device
from connector.kv_pattern import KVPattern
from kvevents.sim.block_pool import BlockPool
from kvevents.sim.config import EngineConfig
from kvevents.sim.request import Request, RequestResult, RequestStatus
from kvevents.sim.scheduler import Scheduler, StepPlan


class PagedEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        offload: OffloadConfig | None = None,
        connector: OffloadCore | None = None,
        publisher: EventPublisher | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        if offload is not None and connector is not None:
            raise ValueError("pass either offload or connector, not both")
        layout = self.config.layout
        self.device = self.config.device or default_device()
        self.connector = connector or (CPUOffloadCore(offload, layout) if offload is not None else None)
        self.publisher = publisher or NullEventPublisher()
        self.pool = BlockPool(self.config.num_gpu_blocks, layout.block_size)
        self.kv_caches = layout.allocate(self.config.num_gpu_blocks, self.device)
        self.pattern = KVPattern(layout, self.device)
        if self.connector is not None:
            self.connector.attach_kv_caches(self.kv_caches)
        self.scheduler = Scheduler(self.pool, self.connector, self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.clock = 0.0  # simulated seconds
        self.kv_mismatches = 0  # loaded blocks that differ from recomputation
        self.verified_blocks = 0
        self.steps = 0
        self._delayed: dict[str, Request] = {}  # finished, blocks held for stores
        self._newly_delayed: set[str] = set()
        self._pending_events: list[Event] = []
        self._ids: set[str] = set()

    # -- public API --------------------------------------------------------------

    def add_request(
        self, req_id: str, token_ids: list[int], max_new_tokens: int = 1,
        arrival_time: float | None = None, lora_name: str | None = None,
    ) -> None:
        """Queue a request; raises ``ValueError`` for a duplicate id or one that can never fit."""
        if req_id in self._ids:
            raise ValueError(f"duplicate request id {req_id!r}")
        req = Request(req_id, list(token_ids), max_new_tokens,
                      self.clock if arrival_time is None else arrival_time,
                      self.config.layout.block_size, lora_name)
        self.scheduler.add(req)
        self._ids.add(req_id)

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._delayed or
                    (self.connector is not None and self.connector.has_pending_transfers()))

    def step(self) -> list[RequestResult]:
        """One engine iteration; returns the requests that finished in it."""
        self.steps += 1
        sched = self.scheduler
        if not sched.running and sched.waiting and not sched.loading and sched.waiting[0].arrival_time > self.clock:
            self.clock = sched.waiting[0].arrival_time  # idle until the next arrival
        plan = sched.schedule(self.clock)
        if not plan.schedule.requests and self.connector is not None and self.connector.has_pending_transfers():
            # Nothing to compute until a transfer lands: wait for it instead of spinning.
            self.connector.wait_for_transfers(timeout=0.05)
        transfers = None
        if self.connector is not None:
            transfers = self.connector.plan_step(plan.schedule)
            self.connector.start_loads(transfers)
        self._forward(plan)
        if transfers is not None:
            self.connector.submit_stores(transfers)
        self.clock += self._step_cost(plan)
        finished = self._advance(plan)
        if self.connector is not None:
            self._collect_transfers()
        self._publish()
        return finished

    def run_until_idle(self, max_steps: int | None = None) -> list[RequestResult]:
        """Step until every request finished and every copy completed (quiesced)."""
        results: list[RequestResult] = []
        n = 0
        while self.has_work():
            results.extend(self.step())
            n += 1
            if max_steps is not None and n >= max_steps:
                break
        return results

    def reset_prefix_cache(self) -> bool:
        """Drop the GPU prefix cache and the CPU tier; False (nothing done) unless idle."""
        if self.has_work():
            return False
        if self.connector is not None and not self.connector.reset_cache():
            return False
        if not self.pool.reset():
            return False
        self._publish()
        return True

    def cache_contents(self) -> dict[str, set[int]]:
        """The engine block hashes truly resident per tier ("GPU", "CPU")."""
        out = {MEDIUM_GPU: set(self.pool.cached), MEDIUM_CPU: set()}
        if self.connector is not None:
            for tier, hashes in self.connector.cached_block_hashes().items():
                out.setdefault(tier, set()).update(hashes)
        return out

    def load(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "waiting": len(s.waiting) + len(s.loading),
            "running": len(s.running),
            "kv_usage": self.pool.num_used() / self.pool.num_blocks,
        }

    def offload_stats(self) -> dict[str, float]:
        return self.connector.stats() if self.connector is not None else {}

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.wait_for_transfers(timeout=10.0)
            self.connector.shutdown()

    # -- internals ---------------------------------------------------------------

    def _forward(self, plan: StepPlan) -> None:
        if not plan.schedule.requests:
            return
        bs = self.config.layout.block_size
        toks, poss, slots = [], [], []
        for sr in plan.schedule.requests:
            a, n = sr.num_computed_tokens, sr.num_scheduled_tokens
            req = sr.request
            pos = np.arange(a, a + n, dtype=np.int64)
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            toks.append(np.asarray(req.all_token_ids[a : a + n], dtype=np.int64))
            poss.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
        self.pattern.write(self.kv_caches, np.concatenate(toks), np.concatenate(poss), np.concatenate(slots))

    def _step_cost(self, plan: StepPlan) -> float:
        tm = self.config.time_model
        if not plan.schedule.requests and not plan.num_load_tokens:
            return 0.0
        return (tm.step_overhead_s + plan.num_prefill_tokens * tm.prefill_s_per_token
                + (tm.decode_s_per_step if plan.num_decode_reqs else 0.0)
                + plan.num_load_tokens * tm.load_s_per_token)

    def _sample(self, req: Request) -> int:
        # Deterministic "sampling": the next token depends on the last one and position.
        return (req.all_token_ids[-1] * 1103515245 + req.num_tokens * 12345) % self.config.vocab_size

    def _advance(self, plan: StepPlan) -> list[RequestResult]:
        bs = self.config.layout.block_size
        finished: list[RequestResult] = []
        for sr in plan.schedule.requests:
            req = sr.request
            assert isinstance(req, Request)
            req.num_computed_tokens += sr.num_scheduled_tokens
            self.pool.cache_full_blocks(req, req.num_computed_tokens // bs)
            if req.num_computed_tokens < req.num_tokens:
                continue  # chunked prefill continues next step
            if req.first_token_time is None:
                req.first_token_time = self.clock
            if req.num_output_tokens + 1 >= req.max_new_tokens:
                req.append_token(self._sample(req))
                finished.append(self._finish(req))
            else:
                req.append_token(self._sample(req))
        return finished

    def _finish(self, req: Request) -> RequestResult:
        self.scheduler.running.remove(req)
        req.status = RequestStatus.FINISHED
        keep = self.connector.on_request_finished(req, req.block_ids) if self.connector is not None else False
        if keep:
            self._delayed[req.request_id] = req
            self._newly_delayed.add(req.request_id)
        else:
            self.pool.free(req.block_ids)
        assert req.first_token_time is not None
        return RequestResult(
            req.request_id, req.arrival_time, req.first_token_time, self.clock, req.num_prompt_tokens,
            req.num_output_tokens, req.num_gpu_cached_tokens, req.num_cpu_loaded_tokens, req.output_token_ids,
        )

    def _collect_transfers(self) -> None:
        assert self.connector is not None
        if self.config.sync_transfers:
            self.connector.wait_for_transfers(timeout=30.0)
        report = self.connector.collect(self._newly_delayed)
        self._newly_delayed = set()
        self.connector.on_worker_report(report)
        bs = self.config.layout.block_size
        for req_id in report.loaded:
            first_block = self.scheduler.loading[req_id].num_computed_tokens // bs if req_id in self.scheduler.loading else 0
            req = self.scheduler.load_finished(req_id, req_id not in report.load_failed)
            if req is None:
                continue
            end_block = req.num_computed_tokens // bs
            if self.config.verify_loads and end_block > first_block:
                toks = np.asarray(req.all_token_ids[first_block * bs : end_block * bs], dtype=np.int64)
                blocks = np.asarray(req.block_ids[first_block:end_block], dtype=np.int64)
                self.kv_mismatches += self.pattern.count_mismatched_blocks(self.kv_caches, toks, first_block * bs, blocks)
                self.verified_blocks += end_block - first_block
            # Loaded blocks are full and valid: they join the GPU prefix cache (as vLLM does).
            self.pool.cache_full_blocks(req, end_block)
        for req_id in report.releasable:
            req = self._delayed.pop(req_id, None)
            if req is not None:
                self.pool.free(req.block_ids)

    def _publish(self) -> None:
        events: list[Event] = self.pool.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events,
                                                data_parallel_rank=self.config.data_parallel_rank))
