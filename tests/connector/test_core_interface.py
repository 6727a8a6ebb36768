"""The core's own interface, driven by hand in the step order ``connector.base`` documents.

No engine in between: a request (the simulator's real ``Request``, which carries token
ids and the block hash chain), KV tensors from ``KVCacheLayout.allocate`` written with
``KVPattern``, and a real transfer handler thread.
"""

from __future__ import annotations

import numpy as np
import pytest

from connector import CPUOffloadCore, KVCacheLayout, MultiConnector, OffloadConfig
from connector.kv_pattern import KVPattern
from connector.step import ScheduledRequest, StepSchedule, StepTransfers
from kvevents.wire.schema import BlockStored
from kvevents.sim.request import Request

BS = 16


def _write(pattern, kv, req, block_ids, n_tokens):
    pos = np.arange(n_tokens, dtype=np.int64)
    slots = np.asarray(block_ids, dtype=np.int64)[pos // BS] * BS + pos % BS
    pattern.write(kv, np.asarray(req.all_token_ids[:n_tokens], dtype=np.int64), pos, slots)


def test_store_then_load_back_in_step_order_bit_exact():
    layout = KVCacheLayout(block_size=BS)
    core = CPUOffloadCore(OffloadConfig(cpu_capacity_blocks=16, offloaded_block_size=2 * BS), layout)
    kv = layout.allocate(32, "cpu")
    pattern = KVPattern(layout, "cpu")
    core.attach_kv_caches(kv)
    try:
        prompt = list(range(1000, 1000 + 4 * BS + 3))  # 4 full blocks = 2 chunks, + 3 tokens
        a = Request("a", prompt, 1, 0.0, BS)
        assert core.match_offloaded(a, 0) == 0  # cold tier
        a_blocks = list(range(5))
        core.on_blocks_allocated(a, a_blocks, 0)
        transfers = core.plan_step(StepSchedule([ScheduledRequest(a, a_blocks, 0, len(prompt))]))
        assert transfers.loads == [] and len(transfers.stores) == 1
        assert transfers.stores[0].src_ids.tolist() == [0, 1, 2, 3]
        core.start_loads(transfers)
        _write(pattern, kv, a, a_blocks, len(prompt))  # the forward pass
        core.submit_stores(transfers)
        # The request finishes while its store may be in flight: the core keeps its blocks
        # until the worker side reports it releasable.
        keep = core.on_request_finished(a, a_blocks)
        delayed = {"a"} if keep else set()
        released: set[str] = set()
        for _ in range(200):
            assert core.wait_for_transfers(timeout=5.0)
            report = core.collect(delayed)
            delayed = set()
            core.on_worker_report(report)
            released |= report.releasable
            if not core.has_pending_transfers():
                break
        assert released == ({"a"} if keep else set())
        events = core.take_events()
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert stored == list(a.block_hashes[:4])  # self-describing, one per engine block
        assert core.cached_block_hashes() == {"CPU": set(a.block_hashes[:4])}

        # Same prefix, new request, fresh blocks: the tier serves both chunks.
        b = Request("b", prompt[: 4 * BS] + [7, 8, 9, 10], 1, 0.0, BS)
        n = core.match_offloaded(b, 0)
        assert n == 4 * BS
        b_blocks = list(range(10, 15))
        core.on_blocks_allocated(b, b_blocks, n)
        transfers = core.plan_step(StepSchedule())
        assert [t.dst_ids.tolist() for t in transfers.loads] == [[10, 11, 12, 13]]
        core.start_loads(transfers)
        core.submit_stores(transfers)
        assert core.wait_for_transfers(timeout=5.0)
        report = core.collect(set())
        assert report.loaded == {"b"} and report.load_failed == set()
        core.on_worker_report(report)
        toks = np.asarray(b.all_token_ids[: 4 * BS], dtype=np.int64)
        assert pattern.count_mismatched_blocks(kv, toks, 0, np.arange(10, 14)) == 0
        assert pattern.count_mismatched_blocks(kv, toks, 0, np.arange(20, 24)) == 4  # never written
        assert core.stats()["load_jobs"] == 1 and core.stats()["store_jobs"] == 1
    finally:
        core.shutdown()


def test_multi_connector_rejects_transfers_it_did_not_plan():
    layout = KVCacheLayout(block_size=BS)
    children = [CPUOffloadCore(OffloadConfig(cpu_capacity_blocks=4, offloaded_block_size=BS), layout) for _ in range(2)]
    multi = MultiConnector(children)
    multi.attach_kv_caches(layout.allocate(8, "cpu"))
    try:
        with pytest.raises(ValueError, match="its own plan_step"):
            multi.start_loads(StepTransfers())
        plan = multi.plan_step(StepSchedule())
        assert plan.children is not None and len(plan.children) == 2
        multi.start_loads(plan)
        multi.submit_stores(plan)
    finally:
        multi.shutdown()
