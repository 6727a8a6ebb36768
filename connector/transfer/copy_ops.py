"""Batched block copies between a KV cache and the CPU pool, with no per-block Python loop.

Every tensor here is ``[num_blocks, ...]`` with a block as one contiguous row, viewed as
2-D rows of int64 (fewer, wider elements than fp16). Gathers (stores into the pool) use
torch ``index_select``, which copies row by row on the OpenMP pool. Scatters (loads into
scattered engine blocks) use numpy fancy assignment on a view with one opaque ``void``
element per row: a memmove per row with the GIL released; torch's CPU ``index_copy_`` /
``index_put_`` move element by element and ran a load at ~0.3x a plain copy. numpy is
single-threaded, so the CPU handler splits large scatter jobs over threads.

Strategy for one batch (``src_ids[i] -> dst_ids[i]``), chosen from the ids alone:

1. runs where *both* sides are consecutive: one slice copy per run (a fresh engine
   allocates consecutive blocks, and the pool allocates ascending rows);
2. else runs of consecutive rows on the pool side (the usual case: the offload manager
   hands out ascending pool rows, while engine blocks are scattered): one gather
   (store, written straight into the pool slice) or one scatter (load, read straight
   from the pool slice) per run, a single pass over the bytes;
3. else (both sides fragmented) one vectorised gather into a temporary, then one scatter.

A loop per run is used only while runs average at least ``MIN_AVG_RUN`` blocks, so the
number of Python-level ops stays small. Tensors that cannot be viewed as rows (not
contiguous, not on CPU) fall back to the torch index ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

# Use run-wise copies only while runs average at least this many blocks.
MIN_AVG_RUN = 4


def runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """``[(i, j), ...]`` position ranges where ``ids[i:j]`` are consecutive integers."""
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    return list(zip(starts.tolist(), ends.tolist()))


def joint_runs(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int]]:
    """Position ranges where ``a`` and ``b`` are both consecutive integers."""
    if a.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [a.size]))
    return list(zip(starts.tolist(), ends.tolist()))


def use_runs(pool_runs: list[tuple[int, int]], n: int) -> bool:
    return len(pool_runs) * MIN_AVG_RUN <= n


def check_ids(ids: np.ndarray, rows: int) -> None:
    """Out-of-range ids must fail the job: a slice past the end would silently be empty."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"block ids out of range [0, {rows})")


def row_view(t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray] | None:
    """Two views sharing ``t``'s memory, one row per block: a 2-D tensor of the widest
    integer type that tiles a row (int64 for KV blocks), and a 1-D numpy array with one
    ``void`` element per row. None when ``t`` is not a plain contiguous CPU tensor (the
    caller then uses torch ops on ``t`` itself).
    """
    if t.device.type != "cpu" or t.dim() == 0 or t.numel() == 0 or not t.is_contiguous():
        return None
    if t.is_conj() or t.is_neg():
        return None
    try:
        raw = t.detach().reshape(t.shape[0], -1).view(torch.uint8)
        row_bytes = raw.shape[1]
        wide = raw
        for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if row_bytes % size == 0 and raw.data_ptr() % size == 0:
                wide = raw.view(dt)
                break
        arr = raw.numpy().view(np.dtype((np.void, row_bytes))).reshape(-1)
    except (RuntimeError, TypeError, ValueError):
        return None
    return wide, arr


# ---- plan: the list of copy ops for one batch, shared by every layer --------------------


def plan_copy(src_ids: np.ndarray, dst_ids: np.ndarray, pool_is_dst: bool) -> list[tuple]:
    """Ops for ``dst[dst_ids] = src[src_ids]``, as tuples the ``apply_*`` functions run.

    ``("slice", a, b, k)``: ``dst[b:b+k] = src[a:a+k]``.
    ``("gather", idx, b)``: ``dst[b:b+len(idx)] = src[idx]`` (pool side is dst).
    ``("scatter", a, idx)``: ``dst[idx] = src[a:a+len(idx)]`` (pool side is src).
    ``("general", sidx, didx)``: ``dst[didx] = src[sidx]``.
    """
    n = int(src_ids.size)
    if n == 0:
        return []
    both = joint_runs(src_ids, dst_ids)
    if use_runs(both, n):
        return [("slice", int(src_ids[i]), int(dst_ids[i]), j - i) for i, j in both]
    pool_ids = dst_ids if pool_is_dst else src_ids
    pool_runs = runs(pool_ids)
    if use_runs(pool_runs, n):
        if pool_is_dst:
            return [("gather", src_ids[i:j], int(dst_ids[i])) for i, j in pool_runs]
        return [("scatter", int(src_ids[i]), dst_ids[i:j]) for i, j in pool_runs]
    return [("general", src_ids, dst_ids)]


def apply_rows(ops: Sequence[tuple], src: tuple[torch.Tensor, np.ndarray],
               dst: tuple[torch.Tensor, np.ndarray]) -> None:
    """Run ``plan_copy`` ops on ``row_view`` pairs (ids already range-checked).

    Slices and gathers use torch (a parallel memcpy per run / per row, the same kernels
    as a plain copy); scatters use numpy's fancy assignment (a memmove per row, GIL
    released), since torch's CPU ``index_copy_`` / ``index_put_`` copy element by element.
    """
    src_t, src_a = src
    dst_t, dst_a = dst
    for op in ops:
        kind = op[0]
        if kind == "slice":
            _, a, b, k = op
            dst_t[b : b + k].copy_(src_t[a : a + k])
        elif kind == "gather":
            _, idx, b = op
            torch.index_select(src_t, 0, torch.from_numpy(idx), out=dst_t[b : b + idx.size])
        elif kind == "scatter":
            _, a, idx = op
            dst_a[idx] = src_a[a : a + idx.size]
        else:
            _, sidx, didx = op
            dst_a[didx] = src_t.index_select(0, torch.from_numpy(sidx)).numpy().view(dst_a.dtype).reshape(-1)


def apply_torch(ops: Sequence[tuple], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Run ``plan_copy`` ops with torch index ops (tensors with no ``row_view``)."""
    for op in ops:
        kind = op[0]
        if kind == "slice":
            _, a, b, k = op
            dst[b : b + k].copy_(src[a : a + k])
        elif kind == "gather":
            _, idx, b = op
            torch.index_select(src, 0, torch.from_numpy(idx), out=dst[b : b + idx.size])
        elif kind == "scatter":
            _, a, idx = op
            dst.index_copy_(0, torch.from_numpy(idx), src[a : a + idx.size])
        else:
            _, sidx, didx = op
            dst.index_copy_(0, torch.from_numpy(didx), src.index_select(0, torch.from_numpy(sidx)))


def copy_rows(src: torch.Tensor, dst: torch.Tensor, ops: Sequence[tuple],
              src_rows: tuple | None = None, dst_rows: tuple | None = None) -> None:
    if src_rows is None:
        src_rows = row_view(src)
    if dst_rows is None:
        dst_rows = row_view(dst)
    if (src_rows is not None and dst_rows is not None and src_rows[1].dtype == dst_rows[1].dtype
            and src_rows[0].dtype == dst_rows[0].dtype):
        apply_rows(ops, src_rows, dst_rows)
    else:
        apply_torch(ops, src, dst)


def uses_numpy(ops: Sequence[tuple]) -> bool:
    """Whether ``apply_rows`` runs numpy scatters (single-threaded) for these ops."""
    return any(op[0] in ("scatter", "general") for op in ops)


# ---- public single-layer helpers (API kept) ----------------------------------------------


def store_blocks(
    src: torch.Tensor, dst_pool: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray
) -> None:
    """``dst_pool[dst_ids] = src[src_ids]`` along dim 0, same device (CPU)."""
    check_ids(src_ids, src.shape[0])
    check_ids(dst_ids, dst_pool.shape[0])
    copy_rows(src, dst_pool, plan_copy(src_ids, dst_ids, pool_is_dst=True))


def load_blocks(
    src_pool: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray
) -> None:
    """``dst[dst_ids] = src_pool[src_ids]`` along dim 0, same device (CPU)."""
    check_ids(src_ids, src_pool.shape[0])
    check_ids(dst_ids, dst.shape[0])
    copy_rows(src_pool, dst, plan_copy(src_ids, dst_ids, pool_is_dst=False))


def split_positions(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` near-equal position ranges covering ``[0, n)`` (empty ones dropped)."""
    bounds = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


Task = Callable[[], None]
