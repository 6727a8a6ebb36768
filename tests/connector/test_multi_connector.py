import random

from connector import CPUOffloadCore, KVCacheLayout, MultiConnector, OffloadConfig
from kvevents.sim import EngineConfig, PagedEngine


def test_loads_from_first_child_with_hits_saves_to_all_and_merges():
    rng = random.Random(0)
    layout = KVCacheLayout()
    small = CPUOffloadCore(OffloadConfig(cpu_capacity_blocks=2, offloaded_block_size=32), layout)
    big = CPUOffloadCore(OffloadConfig(cpu_capacity_blocks=64, offloaded_block_size=32), layout)
    multi = MultiConnector([small, big])
    eng = PagedEngine(EngineConfig(num_gpu_blocks=48, max_num_batched_tokens=256), connector=multi)
    try:
        shared = [rng.randrange(32000) for _ in range(320)]
        eng.add_request("a", shared + [1, 2, 3], 2)
        eng.run_until_idle()
        # Both children stored; the small one only kept what fits (2 chunks).
        assert small.stats()["stored_chunks"] > 0 and big.stats()["stored_chunks"] >= 10
        for i in range(3):
            eng.add_request(f"f{i}", [rng.randrange(32000) for _ in range(500)], 2)
        eng.run_until_idle()
        eng.add_request("b", shared + [4, 5, 6], 2)
        (res,) = eng.run_until_idle()
        # The small child lost the prefix's head, so the big child served the load.
        assert small.stats()["load_jobs"] == 0 and big.stats()["load_jobs"] == 1
        assert res.num_cpu_loaded_tokens == 320 and eng.kv_mismatches == 0
        merged = eng.offload_stats()
        assert merged["store_jobs"] == small.stats()["store_jobs"] + big.stats()["store_jobs"]
        assert eng.cache_contents()["CPU"] == big.cached_block_hashes()["CPU"] | small.cached_block_hashes()["CPU"]
        assert not eng.has_work()  # every delayed request was released by both children
    finally:
        eng.shutdown()
