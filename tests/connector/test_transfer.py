import numpy as np
import pytest
import torch

from connector.kv_layout import KVCacheLayout
from connector.transfer import CpuTransferHandler, Direction, TransferJob, make_transfer_handler


def fill(kv):
    g = torch.Generator().manual_seed(0)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


@pytest.mark.parametrize("pool_ids", ["contiguous", "fragmented"])
def test_round_trip_is_bit_exact(pool_ids):
    layout = KVCacheLayout(num_layers=3)
    eng = layout.allocate(64, "cpu")
    pool = layout.allocate(128, "cpu")
    fill(eng)
    src = np.random.default_rng(1).permutation(64)[:40].astype(np.int64)
    dst = np.arange(10, 50, dtype=np.int64) if pool_ids == "contiguous" else np.random.default_rng(2).permutation(128)[:40].astype(np.int64)
    h = CpuTransferHandler(eng, pool)
    try:
        h.submit(TransferJob(1, Direction.STORE, src, dst))
        assert h.wait(10)
        (res,) = h.take_finished()
        assert res.success
        assert res.num_bytes == 40 * layout.bytes_per_block and res.seconds >= 0
        for name in eng:
            assert torch.equal(pool[name][torch.from_numpy(dst)], eng[name][torch.from_numpy(src)])
        expect = {k: v.clone() for k, v in eng.items()}
        back = np.random.default_rng(3).permutation(64)[:40].astype(np.int64)
        h.submit(TransferJob(2, Direction.LOAD, dst, back))
        assert h.wait(10)
        assert [r.job_id for r in h.take_finished()] == [2]
        for name in eng:
            assert torch.equal(eng[name][torch.from_numpy(back)], expect[name][torch.from_numpy(src)])
    finally:
        h.shutdown()


def test_completions_in_submission_order_and_failure_reported():
    layout = KVCacheLayout()
    eng, pool = layout.allocate(16, "cpu"), layout.allocate(16, "cpu")
    h = make_transfer_handler(eng, pool)
    try:
        ids = np.arange(4, dtype=np.int64)
        h.submit(TransferJob(1, Direction.STORE, ids, ids))
        h.submit(TransferJob(2, Direction.STORE, ids, ids + 100))  # out of range: fails
        h.submit(TransferJob(3, Direction.LOAD, ids, ids))
        assert h.wait(10)
        res = h.take_finished()
        assert [r.job_id for r in res] == [1, 2, 3]
        assert [r.success for r in res] == [True, False, True]
        assert h.pending() == 0
    finally:
        h.shutdown()


@pytest.mark.cuda
def test_cuda_round_trip_is_bit_exact():
    layout = KVCacheLayout(num_layers=2)
    eng = layout.allocate(64, "cuda")
    pool = layout.allocate(128, "cpu", pin=True)
    fill(eng)
    h = make_transfer_handler(eng, pool)
    src = np.random.default_rng(1).permutation(64)[:40].astype(np.int64)
    dst = np.random.default_rng(2).permutation(128)[:40].astype(np.int64)
    h.submit(TransferJob(1, Direction.STORE, src, dst))
    assert h.wait(10)
    assert [r.success for r in h.take_finished()] == [True]
    expect = {k: v.clone() for k, v in eng.items()}
    back = np.random.default_rng(3).permutation(64)[:40].astype(np.int64)
    h.submit(TransferJob(2, Direction.LOAD, dst, back))
    assert h.wait(10)
    assert [r.job_id for r in h.take_finished()] == [2]
    for name in eng:
        assert torch.equal(eng[name][torch.from_numpy(back).cuda()], expect[name][torch.from_numpy(src).cuda()])


@pytest.mark.parametrize("case", ["both_contiguous", "engine_scattered", "both_fragmented"])
def test_copy_strategies_bit_exact(case, monkeypatch):
    """Every copy plan (slice runs, pool runs, general) and the chunked multi-thread path."""
    import connector.transfer.cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "PARALLEL_MIN_BYTES", 0)  # force chunking even for small jobs
    monkeypatch.setattr(cpu_mod, "MIN_CHUNK_BYTES", 1)
    layout = KVCacheLayout(num_layers=2, dtype=torch.bfloat16)  # no numpy bfloat16: byte views
    eng, pool = layout.allocate(96, "cpu"), layout.allocate(64, "cpu")
    fill(eng)
    rng = np.random.default_rng(7)
    if case == "both_contiguous":
        src, dst, back = np.arange(5, 37), np.arange(0, 32), np.arange(50, 82)
    elif case == "engine_scattered":
        p = rng.permutation(96)
        src, dst, back = p[:32], np.arange(10, 42), p[32:64]
    else:
        p = rng.permutation(96)
        src, dst, back = p[:32], rng.permutation(64)[:32], p[32:64]
    src, dst, back = (a.astype(np.int64) for a in (src, dst, back))
    expect = {k: v.clone() for k, v in eng.items()}
    h = CpuTransferHandler(eng, pool)
    try:
        h.submit(TransferJob(1, Direction.STORE, src, dst))
        h.submit(TransferJob(2, Direction.LOAD, dst, back))
        assert h.wait(10)
        assert [(r.job_id, r.success) for r in h.take_finished()] == [(1, True), (2, True)]
        for k in eng:
            assert torch.equal(pool[k][torch.from_numpy(dst)], expect[k][torch.from_numpy(src)])
            assert torch.equal(eng[k][torch.from_numpy(back)], expect[k][torch.from_numpy(src)])
    finally:
        h.shutdown()


def test_non_contiguous_tensors_fall_back_to_torch():
    from connector.transfer.copy_ops import load_blocks, row_view, store_blocks

    base = torch.randn(8, 4, 6)
    src = base.transpose(1, 2)  # not contiguous: no row view
    assert row_view(src) is None
    pool = torch.zeros(8, 6, 4)
    ids = np.array([3, 1, 6], dtype=np.int64)
    store_blocks(src, pool, ids, np.array([0, 1, 2], dtype=np.int64))
    assert torch.equal(pool[:3], src[torch.from_numpy(ids)])
    out = torch.zeros(8, 4, 6).transpose(1, 2)
    load_blocks(pool, out, np.array([0, 1, 2], dtype=np.int64), ids)
    assert torch.equal(out[torch.from_numpy(ids)], src[torch.from_numpy(ids)])
