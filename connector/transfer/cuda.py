"""Transfer handler for CUDA KV caches: pinned host pool, one stream per direction.

A store waits (on its stream) for the compute stream's work so far, gathers the blocks
on the GPU with one ``index_select`` into a contiguous staging tensor, then copies
device->host run by run into the pinned pool (runs of consecutive pool rows, usually
few). A load does the reverse: host->device runs into staging, then one
``index_copy_`` into the KV cache. Each job records a CUDA event; ``take_finished()``
polls events per direction in submission order, so completions are reported in order.
Staging tensors are kept referenced by their job until its event has completed.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch

from connector.transfer.abstract import Direction, TransferHandler, TransferJob, TransferResult
from connector.transfer.copy_ops import check_ids, runs


@dataclass
class _InFlight:
    job: TransferJob
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep_alive: list[torch.Tensor] = field(default_factory=list)


class CudaTransferHandler(TransferHandler):
    def __init__(self, engine_kv: dict[str, torch.Tensor], cpu_pool: dict[str, torch.Tensor]) -> None:
        if engine_kv.keys() != cpu_pool.keys():
            raise ValueError("engine KV cache and CPU pool must have the same layers")
        self._engine = [engine_kv[k] for k in engine_kv]
        self._pool = [cpu_pool[k] for k in engine_kv]
        if not all(t.is_cuda for t in self._engine):
            raise ValueError("CudaTransferHandler needs CUDA KV caches")
        if not all(t.is_pinned() for t in self._pool):
            raise ValueError("the CPU pool must be in pinned host memory")
        self.device = self._engine[0].device
        self._bytes_per_block = sum(t[0].numel() * t.element_size() for t in self._engine)
        self._streams = {d: torch.cuda.Stream(self.device) for d in Direction}
        self._inflight: dict[Direction, collections.deque[_InFlight]] = {
            d: collections.deque() for d in Direction
        }

    def submit(self, job: TransferJob) -> None:
        gpu_ids = job.src_ids if job.direction is Direction.STORE else job.dst_ids
        pool_ids = job.dst_ids if job.direction is Direction.STORE else job.src_ids
        check_ids(gpu_ids, self._engine[0].shape[0])
        check_ids(pool_ids, self._pool[0].shape[0])
        stream = self._streams[job.direction]
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        rec = _InFlight(job, start, end)
        # The copy must see every kernel the engine queued before this call (a store
        # reads blocks the forward pass just wrote).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            start.record(stream)
            gpu_idx = torch.from_numpy(gpu_ids).to(self.device, non_blocking=True)
            pool_runs = runs(pool_ids)
            rec.keep_alive.append(gpu_idx)
            for gpu, pool in zip(self._engine, self._pool):
                if job.direction is Direction.STORE:
                    staged = gpu.index_select(0, gpu_idx)
                    for i, j in pool_runs:
                        a = int(pool_ids[i])
                        pool[a : a + (j - i)].copy_(staged[i:j], non_blocking=True)
                else:
                    staged = torch.empty((job.num_blocks, *gpu.shape[1:]), dtype=gpu.dtype, device=self.device)
                    for i, j in pool_runs:
                        a = int(pool_ids[i])
                        staged[i:j].copy_(pool[a : a + (j - i)], non_blocking=True)
                    gpu.index_copy_(0, gpu_idx, staged)
                rec.keep_alive.append(staged)
            end.record(stream)
        if job.direction is Direction.LOAD:
            # Later compute on the default stream must not read blocks before they land.
            torch.cuda.current_stream(self.device).wait_event(end)
        self._inflight[job.direction].append(rec)

    def take_finished(self) -> list[TransferResult]:
        out = []
        for direction, q in self._inflight.items():
            while q and q[0].end.query():
                rec = q.popleft()
                seconds = rec.start.elapsed_time(rec.end) / 1000.0
                out.append(
                    TransferResult(rec.job.job_id, direction, True, rec.job.num_blocks * self._bytes_per_block, seconds)
                )
        return out

    def pending(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for q in self._inflight.values():
            for rec in list(q):
                while not rec.end.query():
                    if deadline is not None and time.monotonic() > deadline:
                        return False
                    time.sleep(0.0002)
        return True

    def shutdown(self) -> None:
        self.wait()
