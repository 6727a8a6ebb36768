"""Transfer handler for CPU-resident KV caches: copies on one named worker thread.

Without CUDA the engine's "GPU" cache is a CPU tensor; copying on a thread (torch ops
release the GIL) keeps the engine step from waiting for offload traffic. Jobs run in
submission order, so completions are reported in that order too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from connector.transfer.abstract import Direction, TransferHandler, TransferJob, TransferResult
from connector.transfer.copy_ops import load_blocks, store_blocks

log = logging.getLogger(__name__)


class CpuTransferHandler(TransferHandler):
    """Owns one daemon thread; the tensors stay owned by the caller.

    ``engine_kv`` and ``cpu_pool`` map layer name -> tensor with the same per-block
    shape. The caller must not free or overwrite a job's source blocks until the job is
    reported finished (the connector delays freeing of blocks being stored).
    """

    def __init__(self, engine_kv: dict[str, torch.Tensor], cpu_pool: dict[str, torch.Tensor]) -> None:
        if engine_kv.keys() != cpu_pool.keys():
            raise ValueError("engine KV cache and CPU pool must have the same layers")
        self._engine = [engine_kv[k] for k in engine_kv]
        self._pool = [cpu_pool[k] for k in engine_kv]
        self._bytes_per_block = sum(t[0].numel() * t.element_size() for t in self._engine)
        self._jobs: queue.SimpleQueue[TransferJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-offload-transfer", daemon=True)
        self._thread.start()

    def submit(self, job: TransferJob) -> None:
        if self._closed:
            raise RuntimeError("transfer handler is shut down")
        with self._idle:
            self._pending += 1
        self._jobs.put(job)

    def get_finished(self) -> list[TransferResult]:
        out: list[TransferResult] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        if out:
            with self._idle:
                self._pending -= len(out)
        return out

    def pending(self) -> int:
        return self._pending

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending - self._done.qsize() > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t0 = time.perf_counter()
            ok = True
            try:
                self.run_job(job)
            except Exception:  # reported as a failed job; the thread keeps serving
                log.exception("transfer job %d failed", job.job_id)
                ok = False
            result = TransferResult(
                job.job_id, job.direction, ok, job.num_blocks * self._bytes_per_block,
                time.perf_counter() - t0,
            )
            with self._idle:
                self._done.put(result)
                self._idle.notify_all()

    def run_job(self, job: TransferJob) -> None:
        """The copy itself, synchronously (also used by benchmarks)."""
        if job.direction is Direction.STORE:
            for src, pool in zip(self._engine, self._pool):
                store_blocks(src, pool, job.src_ids, job.dst_ids)
        else:
            for pool, dst in zip(self._pool, self._engine):
                load_blocks(pool, dst, job.src_ids, job.dst_ids)
