"""Transfer handler for CUDA KV caches: pinned host pool, two streams per direction.

A store waits for the compute stream's work so far, then, layer by layer, gathers the
blocks on the GPU with one ``index_select`` into a contiguous staging tensor (on the
direction's kernel stream) and copies it device->host run by run into the pinned pool
(runs of consecutive pool rows, usually few; on the direction's copy stream). A load
does the reverse: host->device runs into staging (copy stream), then one ``index_copy_``
per layer into the KV cache (kernel stream). The two streams pipeline the layers: layer
i+1's gather runs while layer i crosses PCIe, so the copy engine is never idle waiting
for a kernel (serialised, the gathers cost a store about 10% of a plain copy's speed).
Each job records an end event on the stream that finishes it; ``take_finished()`` polls
those per direction in submission order, so completions are reported in order. Staging
tensors are kept referenced by their job until its end event has completed.

Failure: ``submit`` never raises for a job. Ids out of range, an out-of-memory staging
allocation or any other error while queueing the copies makes the job a failed result
(``success=False``), reported in its place in the order once the copies queued before
the error have finished; the handler stays usable. The caller rolls a failed store back
and recomputes a failed load.

The streams come from a :class:`connector.transfer.streams.StreamOps`: CUDA's own by
default; :class:`~connector.transfer.streams.HostStreams` runs this code on CPU tensors
(the GPU check's dry run).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.transfer.abstract import Direction, TransferHandler, TransferJob, TransferResult
from connector.transfer.copy_ops import check_ids, runs
from connector.transfer.streams import CudaStreams, StreamOps

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    job: TransferJob
    start: Any
    end: Any
    ok: bool = True
    keep_alive: list[torch.Tensor] = field(default_factory=list)


class CudaTransferHandler(TransferHandler):
    def __init__(
        self, engine_kv: dict[str, torch.Tensor], cpu_pool: dict[str, torch.Tensor], streams: StreamOps | None = None
    ) -> None:
        if engine_kv.keys() != cpu_pool.keys():
            raise ValueError("engine KV cache and CPU pool must have the same layers")
        self._ops: StreamOps = CudaStreams() if streams is None else streams
        self._engine = [engine_kv[k] for k in engine_kv]
        self._pool = [cpu_pool[k] for k in engine_kv]
        if self._ops.requires_pinned:
            if not all(t.is_cuda for t in self._engine):
                raise ValueError("CudaTransferHandler needs CUDA KV caches")
            if not all(t.is_pinned() for t in self._pool):
                raise ValueError("the CPU pool must be in pinned host memory")
        self.device = self._engine[0].device
        self._bytes_per_block = sum(t[0].numel() * t.element_size() for t in self._engine)
        # Per direction: (copy stream: PCIe transfers, kernel stream: gathers / scatters).
        self._streams = {d: (self._ops.new_stream(self.device), self._ops.new_stream(self.device)) for d in Direction}
        self._inflight: dict[Direction, collections.deque[_InFlight]] = {
            d: collections.deque() for d in Direction
        }

    def submit(self, job: TransferJob) -> None:
        copy, kernel = self._streams[job.direction]
        rec = _InFlight(job, self._ops.new_event(), self._ops.new_event())
        # The copy must see every kernel the engine queued before this call (a store
        # reads blocks the forward pass just wrote; a load overwrites blocks it may
        # still have been reading).
        compute = self._ops.current_stream(self.device)
        copy.wait_stream(compute)
        kernel.wait_stream(compute)
        last = copy if job.direction is Direction.STORE else kernel
        rec.start.record(kernel)
        try:
            self._enqueue(job, copy, kernel, rec.keep_alive)
        except Exception as exc:  # OOM, bad ids, a CUDA error while queueing
            rec.ok = False
            log.warning("transfer job %d (%s, %d blocks) failed: %s", job.job_id, job.direction.value,
                        job.num_blocks, exc)
        # Recorded even after a failure: whatever was queued before it must finish
        # before the job is reported (its staging tensors are still referenced).
        last.wait_stream(copy if last is kernel else kernel)
        rec.end.record(last)
        if job.direction is Direction.LOAD:
            # Later compute on the default stream must not read blocks before they land.
            compute.wait_event(rec.end)
        self._inflight[job.direction].append(rec)

    def _enqueue(self, job: TransferJob, copy: Any, kernel: Any, keep_alive: list[torch.Tensor]) -> None:
        """Queue the job's gathers / scatters on ``kernel`` and its PCIe copies on ``copy``,
        layer by layer, each side waiting for the other's event of the same layer."""
        store = job.direction is Direction.STORE
        gpu_ids = job.src_ids if store else job.dst_ids
        pool_ids = job.dst_ids if store else job.src_ids
        check_ids(gpu_ids, self._engine[0].shape[0])
        check_ids(pool_ids, self._pool[0].shape[0])
        host_idx = torch.from_numpy(gpu_ids)
        if self._ops.requires_pinned:
            # From pageable memory the copy would wait for this stream, i.e. for the
            # engine's compute the job follows: submit would block the engine.
            host_idx = host_idx.pin_memory()
        with self._ops.use(kernel):
            gpu_idx = host_idx.to(self.device, non_blocking=True)
        pool_runs = runs(pool_ids)
        keep_alive += (host_idx, gpu_idx)
        first, second = (kernel, copy) if store else (copy, kernel)
        for gpu, pool in zip(self._engine, self._pool):
            with self._ops.use(first):
                if store:
                    staged = gpu.index_select(0, gpu_idx)
                else:
                    staged = torch.empty((job.num_blocks, *gpu.shape[1:]), dtype=gpu.dtype, device=self.device)
                    for i, j in pool_runs:
                        a = int(pool_ids[i])
                        staged[i:j].copy_(pool[a : a + (j - i)], non_blocking=True)
                keep_alive.append(staged)
                ready = self._ops.new_event()
                ready.record(first)
            second.wait_event(ready)
            with self._ops.use(second):
                if store:
                    for i, j in pool_runs:
                        a = int(pool_ids[i])
                        pool[a : a + (j - i)].copy_(staged[i:j], non_blocking=True)
                else:
                    gpu.index_copy_(0, gpu_idx, staged)

    def take_finished(self) -> list[TransferResult]:
        out = []
        for direction, q in self._inflight.items():
            while q and q[0].end.query():
                rec = q.popleft()
                seconds = rec.start.elapsed_time(rec.end) / 1000.0
                nbytes = rec.job.num_blocks * self._bytes_per_block  # as the CPU handler reports
                out.append(TransferResult(rec.job.job_id, direction, rec.ok, nbytes, seconds))
        return out

    def pending(self) -> int:
        return sum(len(q) for q in self._inflight.values())

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for q in self._inflight.values():
            for rec in list(q):
                if deadline is None:
                    rec.end.synchronize()  # no polling delay when the caller will wait anyway
                    continue
                while not rec.end.query():
                    if deadline is not None and time.monotonic() > deadline:
                        return False
                    time.sleep(0.0002)
        return True

    def shutdown(self) -> None:
        self.wait()
