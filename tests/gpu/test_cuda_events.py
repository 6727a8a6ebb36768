"""The offload manager's CPU-tier events on the CUDA path: the reference-counted
``BlockStored`` / ``BlockRemoved`` events a paged engine publishes with its KV cache on
the GPU (pinned pool, stream handler) are the ones the CPU simulator publishes for the
same schedule, batch for batch, and every block loaded back is bit-exact."""

from __future__ import annotations

import random

import pytest

from connector import OffloadConfig
from kvevents.sim import EngineConfig, PagedEngine
from kvevents.wire.publisher import EventPublisher
from kvevents.wire.schema import MEDIUM_CPU, BlockRemoved, BlockStored, KVEventBatch, medium_of
from connector.transfer.cuda import CudaTransferHandler
from connector.transfer.streams import HOST_STREAMS_ENV

pytestmark = pytest.mark.cuda


class Collected(EventPublisher):
    """Keeps every published batch (the engine's real publisher interface, no socket)."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> bool:
        self.batches.append(batch)
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        pass


def cpu_tier(batches: list[KVEventBatch]) -> list[list[tuple]]:
    """Per batch, the CPU tier's events as comparable tuples (timestamps dropped)."""
    out = []
    for b in batches:
        evs = []
        for e in b.events:
            if isinstance(e, (BlockStored, BlockRemoved)) and medium_of(e) == MEDIUM_CPU:
                evs.append((type(e).__name__, tuple(e.block_hashes), tuple(getattr(e, "token_ids", ()) or ())))
        out.append(evs)
    return out


def run(device: str, policy: str) -> tuple[list[list[tuple]], list, PagedEngine]:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(n)]

    pub = Collected()
    eng = PagedEngine(
        EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=256, device=device, sync_transfers=True),
        offload=OffloadConfig(cpu_capacity_blocks=48, offloaded_block_size=64, eviction_policy=policy),
        publisher=pub,
    )
    try:
        fillers = [prompt(500) for _ in range(12)]
        for i, p in enumerate(fillers):  # ~94 offloaded blocks through a 48-block CPU tier
            eng.add_request(f"f{i}", p, 2)
        eng.run_until_idle()
        # Gone from the 64-block GPU pool, still on the CPU tier: loaded back.
        eng.add_request("b", fillers[8] + prompt(90), 3)
        results = eng.run_until_idle()
    finally:
        eng.shutdown()
    return cpu_tier(pub.batches), results, eng


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_cpu_tier_events_equal_the_simulators(gpu, policy, monkeypatch):
    events, results, eng = run(gpu.device.type, policy)
    assert isinstance(eng.connector.worker.handler, CudaTransferHandler)
    monkeypatch.delenv(HOST_STREAMS_ENV, raising=False)  # the reference: CPU tensors, threaded copies
    ref_events, ref_results, ref = run("cpu", policy)
    assert not isinstance(ref.connector.worker.handler, CudaTransferHandler)

    flat = [e for b in events for e in b]
    assert any(e[0] == "BlockStored" for e in flat) and any(e[0] == "BlockRemoved" for e in flat)
    assert events == ref_events
    (b,), (ref_b,) = results, ref_results
    assert b.num_cpu_loaded_tokens > 0 and b.num_cpu_loaded_tokens == ref_b.num_cpu_loaded_tokens
    assert b.output_token_ids == ref_b.output_token_ids
    assert eng.kv_mismatches == 0 and eng.verified_blocks > 0
