"""Batched block copies with torch index ops (no per-block Python loop).

The CPU pool side of a transfer is allocated by us in ascending slots, so its ids are
usually a few long runs of consecutive rows. A run on the pool side lets the copy be a
single pass: ``index_select(out=pool[a:b])`` for a store, ``index_copy_(src=pool[a:b])``
for a load, instead of gather-to-temporary then scatter (two passes over the bytes).
When the pool side is fragmented (many short runs) one vectorised gather+scatter over
the whole batch is cheaper than many small ops.
"""

from __future__ import annotations

import numpy as np
import torch

# Use run-wise single-pass copies only while runs average at least this many blocks.
MIN_AVG_RUN = 4


def runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """``[(i, j), ...]`` position ranges where ``ids[i:j]`` are consecutive integers."""
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    return list(zip(starts.tolist(), ends.tolist()))


def use_runs(pool_runs: list[tuple[int, int]], n: int) -> bool:
    return len(pool_runs) * MIN_AVG_RUN <= n


def check_ids(ids: np.ndarray, rows: int) -> None:
    """Out-of-range ids must fail the job: a slice past the end would silently be empty."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"block ids out of range [0, {rows})")


def store_blocks(
    src: torch.Tensor, dst_pool: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray
) -> None:
    """``dst_pool[dst_ids] = src[src_ids]`` along dim 0, same device (CPU)."""
    check_ids(src_ids, src.shape[0])
    check_ids(dst_ids, dst_pool.shape[0])
    src_idx = torch.from_numpy(src_ids)
    pool_runs = runs(dst_ids)
    if use_runs(pool_runs, src_ids.size):
        for i, j in pool_runs:
            a = int(dst_ids[i])
            torch.index_select(src, 0, src_idx[i:j], out=dst_pool[a : a + (j - i)])
    else:
        dst_pool.index_copy_(0, torch.from_numpy(dst_ids), src.index_select(0, src_idx))


def load_blocks(
    src_pool: torch.Tensor, dst: torch.Tensor, src_ids: np.ndarray, dst_ids: np.ndarray
) -> None:
    """``dst[dst_ids] = src_pool[src_ids]`` along dim 0, same device (CPU)."""
    check_ids(src_ids, src_pool.shape[0])
    check_ids(dst_ids, dst.shape[0])
    dst_idx = torch.from_numpy(dst_ids)
    pool_runs = runs(src_ids)
    if use_runs(pool_runs, src_ids.size):
        for i, j in pool_runs:
            a = int(src_ids[i])
            dst.index_copy_(0, dst_idx[i:j], src_pool[a : a + (j - i)])
    else:
        dst.index_copy_(0, dst_idx, src_pool.index_select(0, torch.from_numpy(src_ids)))
