import random

import pytest

from kvevents.wire.schema import BlockStored

from connector import OffloadConfig
from kvevents.sim import EngineConfig, PagedEngine

from offload_helpers import Subscribed, replay


def prompt(rng, n):
    return [rng.randrange(32000) for _ in range(n)]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_evicted_prefix_is_served_from_cpu_bit_exact_and_events_say_so(policy):
    rng = random.Random(0)
    sub = Subscribed()
    eng = PagedEngine(
        EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=256),
        offload=OffloadConfig(cpu_capacity_blocks=64, offloaded_block_size=64, eviction_policy=policy),
        publisher=sub.publisher,
    )
    try:
        shared = prompt(rng, 200)  # 12.5 blocks: chunks of 4 blocks do not align with it
        eng.add_request("a", shared + prompt(rng, 100), 4)
        eng.run_until_idle()
        a_hashes = set(eng.scheduler.pool.cached) | eng.cache_contents()["CPU"]
        # Fillers push the shared prefix out of the 64-block GPU pool.
        for i in range(4):
            eng.add_request(f"f{i}", prompt(rng, 600), 2)
        eng.run_until_idle()
        contents = eng.cache_contents()
        b_prompt = shared + prompt(rng, 90)
        from kvevents.sim.request import Request

        b_hashes = Request("x", b_prompt, 1, 0.0, 16).block_hashes
        assert not set(b_hashes[:12]) & contents["GPU"], "prefix must be gone from GPU"
        assert set(b_hashes[:12]) <= contents["CPU"]
        eng.add_request("b", b_prompt, 3)
        (res,) = eng.run_until_idle()
        assert res.num_cpu_loaded_tokens == 192  # 3 chunks of 64; the 4th needs unshared tokens
        assert res.num_gpu_cached_tokens == 0
        assert eng.kv_mismatches == 0 and eng.verified_blocks >= 12
        # A decode after the load used the loaded KV: output equals a fresh engine's.
        fresh = PagedEngine(EngineConfig(num_gpu_blocks=64, max_num_batched_tokens=256))
        fresh.add_request("b", b_prompt, 3)
        assert fresh.run_until_idle()[0].output_token_ids == res.output_token_ids
        stats = eng.offload_stats()
        assert stats["loaded_bytes"] > 0 and stats["stored_bytes"] > 0

        batches = sub.drain()
        counts, problems = replay(batches)
        assert problems == []  # each block stored once and removed once per tier
        final = eng.cache_contents()
        assert set(counts["GPU"]) == final["GPU"]
        assert set(counts["CPU"]) == final["CPU"]
        cpu_stored = [e for b in batches for e in b.events if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert cpu_stored and all(
            len(e.token_ids) == e.block_size * len(e.block_hashes) and e.block_size == 16 for e in cpu_stored
        )
        announced = [h for e in cpu_stored for h in e.block_hashes]
        for h in b_hashes[:12]:
            assert h in announced
        # Self-describing: tokens of each CPU block match the prompt that produced it.
        by_hash = {}
        for e in cpu_stored:
            for i, h in enumerate(e.block_hashes):
                by_hash[h] = e.token_ids[i * 16 : (i + 1) * 16]
        for i, h in enumerate(b_hashes[:12]):
            assert by_hash[h] == b_prompt[i * 16 : (i + 1) * 16]
        assert a_hashes
    finally:
        eng.shutdown()
        sub.close()


def test_reset_prefix_cache_clears_both_tiers_and_announces_it():
    rng = random.Random(1)
    sub = Subscribed()
    eng = PagedEngine(EngineConfig(num_gpu_blocks=64), offload=OffloadConfig(cpu_capacity_blocks=16, offloaded_block_size=32),
                      publisher=sub.publisher)
    try:
        eng.add_request("a", prompt(rng, 300), 2)
        eng.run_until_idle()
        assert eng.cache_contents()["CPU"]
        assert eng.reset_prefix_cache()
        assert eng.cache_contents() == {"GPU": set(), "CPU": set()}
        counts, problems = replay(sub.drain())
        assert counts == {"GPU": {}, "CPU": {}} and problems == []
    finally:
        eng.shutdown()
        sub.close()


def test_many_concurrent_requests_with_lora_and_load_report():
    rng = random.Random(2)
    eng = PagedEngine(EngineConfig(num_gpu_blocks=256, max_num_batched_tokens=512),
                      offload=OffloadConfig(cpu_capacity_bytes=256 * 4 * 4096, offloaded_block_size=64, eviction_policy="arc"))
    try:
        sys_prompts = [prompt(rng, 300) for _ in range(3)]
        for i in range(30):
            eng.add_request(f"r{i}", sys_prompts[i % 3] + prompt(rng, rng.randrange(50, 400)), 4,
                            arrival_time=i * 0.01, lora_name="ad" if i % 5 == 0 else None)
        load = eng.load()
        assert load["waiting"] == 30 and load["running"] == 0
        results = eng.run_until_idle()
        assert len(results) == 30 and all(r.ttft >= 0 and r.num_output_tokens == 4 for r in results)
        assert sum(r.num_gpu_cached_tokens + r.num_cpu_loaded_tokens for r in results) > 0
        assert eng.kv_mismatches == 0
        assert eng.load()["kv_usage"] == 0.0
    finally:
        eng.shutdown()


def test_request_validation():
    eng = PagedEngine(EngineConfig(num_gpu_blocks=8))
    eng.add_request("a", [1, 2, 3], 1)
    with pytest.raises(ValueError):
        eng.add_request("a", [1], 1)
    with pytest.raises(ValueError):
        eng.add_request("big", [1] * 1000, 1)
