"""The connector's CUDA path: transfers between a paged KV cache on the GPU and pinned
CPU blocks (``connector.transfer.cuda`` through ``OffloadWorker``).

Marked ``cuda``: run on a GPU by ``make gpu-check`` (benchmarks/gpu/check.sh), on CPU
tensors with host stand-ins for streams in its dry run (``make gpu-check CPU=1``, part of
``make test``), skipped otherwise.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from connector.kv_layout import KVCacheLayout, block_major_views
from connector.step import StepTransfers, TransferSpec
from connector.transfer import Direction, TransferJob, make_transfer_handler
from connector.transfer.cuda import CudaTransferHandler
from connector.worker import OffloadWorker

from conftest import spin

pytestmark = pytest.mark.cuda

NB = 96  # engine blocks
# The layouts vLLM's attention backends register (connector.kv_layout.block_major_views).
LAYOUTS = {
    "block-major": ((NB, 16, 2, 4, 64), torch.float16),  # connector.KVCacheLayout
    "vllm-cpu": ((NB, 4, 16, 128), torch.bfloat16),  # [num_blocks, kv_heads, block_size, 2*head_dim]
    "flash-attn": ((2, NB, 16, 4, 64), torch.bfloat16),  # (K|V, num_blocks, block_size, heads, dim)
    "flashinfer": ((NB, 2, 16, 4, 64), torch.float16),  # (num_blocks, K|V, ...)
}


def random_bits(shape, dtype, device, seed) -> torch.Tensor:
    """Random bit patterns (NaNs included): compared as raw bytes, never as floats."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


def ids(a) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_store_and_load_are_byte_exact(gpu, name):
    shape, dtype = LAYOUTS[name]
    kv = {f"layer.{i}": random_bits(shape, dtype, gpu.device, seed=i) for i in range(4)}
    views = block_major_views(kv, NB)
    worker = OffloadWorker(KVCacheLayout(), num_pool_rows=64)
    worker.attach_kv_caches(views)
    try:
        assert isinstance(worker.handler, CudaTransferHandler)
        assert all(t.is_pinned() for t in worker.cpu_pool.values()) == gpu.cuda
        rng = np.random.default_rng(0)
        perm = rng.permutation(NB)
        src, back = ids(perm[:40]), ids(perm[40:80])
        dst = ids(rng.permutation(64)[:40])  # fragmented pool rows
        expect = {k: bits(v[torch.from_numpy(src).to(gpu.device)]) for k, v in views.items()}
        worker.submit_stores(StepTransfers(stores=[TransferSpec(1, "r", src, dst)]))
        assert worker.wait(30)
        (res,) = worker.collect(set()).results
        assert (res.job_id, res.direction, res.success) == (1, Direction.STORE, True)
        for k, pool in worker.cpu_pool.items():
            assert torch.equal(bits(pool[torch.from_numpy(dst)]), expect[k]), k
        worker.start_loads(StepTransfers(loads=[TransferSpec(2, "r", dst, back)]))
        assert worker.wait(30)
        report = worker.collect(set())
        assert report.loaded == {"r"} and not report.load_failed
        for k, v in views.items():
            assert torch.equal(bits(v[torch.from_numpy(back).to(gpu.device)]), expect[k]), k
        # The engine's own tensors (not only the views) hold the blocks, K and V alike.
        if name == "flash-attn":
            for k, t in kv.items():
                got = bits(t[:, torch.from_numpy(back).to(gpu.device)])
                assert torch.equal(got, torch.stack([expect[f"{k}.k"], expect[f"{k}.v"]]))
    finally:
        worker.shutdown()


def test_transfers_follow_compute_and_complete_through_events(gpu):
    """A store sees what the compute stream wrote before it was submitted, and returns at
    once; a load is seen by compute queued after it. Completion comes only via events."""
    layout = KVCacheLayout(num_layers=4, num_kv_heads=8, head_dim=128)
    eng = layout.allocate(257, gpu.device)
    pool = layout.allocate(128, "cpu", pin=gpu.cuda)
    h = make_transfer_handler(eng, pool)
    assert isinstance(h, CudaTransferHandler)
    src, dst, back = ids(range(1, 129)), ids(range(128)), ids(range(129, 257))
    try:
        if gpu.cuda:
            spin(300)  # the "forward pass" still runs when the store is submitted...
        for t in eng.values():
            t[torch.from_numpy(src).to(gpu.device)] = 7  # ...and writes these blocks last
        t0 = time.perf_counter()
        h.submit(TransferJob(1, Direction.STORE, src, dst))
        submit_s = time.perf_counter() - t0
        if gpu.cuda:
            assert submit_s < 0.1, f"submit blocked for {submit_s:.3f} s"
            assert h.take_finished() == [] and h.pending() == 1  # the GPU is still busy
        assert h.wait(30)
        (res,) = h.take_finished()
        assert res.success and res.seconds >= 0 and h.pending() == 0
        for t in pool.values():
            assert bool((t[:128] == 7).all()), "the store ran before the compute it must follow"
            t[:128] = 3
        h.submit(TransferJob(2, Direction.LOAD, dst, back))
        # Queued on the compute stream right after the load: must see the loaded blocks.
        seen = [(t[torch.from_numpy(back).to(gpu.device)] == 3).all() for t in eng.values()]
        assert [bool(s) for s in seen] == [True] * len(seen)
        assert h.wait(30)
        assert [(r.job_id, r.success) for r in h.take_finished()] == [(2, True)]
    finally:
        h.shutdown()


def test_failed_jobs_are_reported_in_order_and_the_handler_goes_on(gpu):
    layout = KVCacheLayout(num_layers=2)
    eng, pool = layout.allocate(32, gpu.device), layout.allocate(32, "cpu", pin=gpu.cuda)
    h = make_transfer_handler(eng, pool)
    try:
        a = ids(range(4))
        h.submit(TransferJob(1, Direction.STORE, a, a))
        h.submit(TransferJob(2, Direction.STORE, a, a + 100))  # pool rows out of range
        h.submit(TransferJob(3, Direction.STORE, a + 4, a + 4))
        h.submit(TransferJob(4, Direction.LOAD, a - 10, a))  # negative pool rows
        h.submit(TransferJob(5, Direction.LOAD, a, a + 8))
        assert h.wait(30)
        got = sorted((r.job_id, r.success) for r in h.take_finished())
        assert got == [(1, True), (2, False), (3, True), (4, False), (5, True)]
        assert h.pending() == 0
    finally:
        h.shutdown()


def test_out_of_memory_is_a_failed_result_not_a_hang(gpu):
    gpu.require_cuda("device memory limits")
    layout = KVCacheLayout(num_layers=4, num_kv_heads=8, head_dim=128)  # 256 KiB a block
    eng, pool = layout.allocate(512, gpu.device), layout.allocate(512, "cpu", pin=True)
    h = make_transfer_handler(eng, pool)
    all_ids = ids(range(512))
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        # Room for the index tensor, not for the 32 MiB staging copy of a layer.
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (4 << 20)) / total))
        try:
            h.submit(TransferJob(1, Direction.STORE, all_ids, all_ids))
            h.submit(TransferJob(2, Direction.LOAD, all_ids, all_ids))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        assert h.wait(30)
        assert sorted((r.job_id, r.success) for r in h.take_finished()) == [(1, False), (2, False)]
        h.submit(TransferJob(3, Direction.STORE, all_ids, all_ids))  # memory back: works again
        assert h.wait(30)
        assert [(r.job_id, r.success) for r in h.take_finished()] == [(3, True)]
    finally:
        h.shutdown()


def test_a_store_overlaps_compute_on_another_stream(gpu):
    """The store's copies and a matmul run as long on another stream run at the same
    time: the pair takes clearly less than the two alone, and the matmul is not held
    back (the GPU benchmark's measurement, on a 512 MiB store of the 7B-like layout)."""
    gpu.require_cuda("stream overlap timing")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
    from bench_gpu import overlap

    ov = overlap(gpu.device, 512)
    assert ov["both_s"] < 0.8 * (ov["store_s"] + ov["matmul_s"]), ov
    assert ov["matmul_slowdown"] < 1.5, ov
