"""Transfer handler for CPU-resident KV caches: copies on one named worker thread.

Without CUDA the engine's "GPU" cache is a CPU tensor; copying on a thread (the numpy
and torch copy ops release the GIL) keeps the engine step from waiting for offload
traffic. Jobs run one at a time in submission order, so completions are reported in that
order too. A large job whose copy runs numpy scatters (single-threaded) is cut into
chunks of block positions that the worker thread and ``torch.get_num_threads() - 1``
helper threads take from a shared list (a plain torch copy of the same bytes also uses
that many threads); the job completes only when every chunk has.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from connector.transfer.abstract import Direction, TransferHandler, TransferJob, TransferResult
from connector.transfer.copy_ops import check_ids, copy_rows, plan_copy, row_view, split_positions, uses_numpy

log = logging.getLogger(__name__)

# Jobs smaller than this run on the worker thread alone (handing chunks to helper
# threads costs tens of microseconds).
PARALLEL_MIN_BYTES = 4 << 20
# Chunks are at least this big, and at most CHUNKS_PER_THREAD per thread, so that a
# thread that is descheduled (other processes on the cores) delays the job by a chunk.
MIN_CHUNK_BYTES = 1 << 20
CHUNKS_PER_THREAD = 4


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
        # Row views, made once (None where a tensor has none: plain torch ops are used).
        self._engine_view = [row_view(t) for t in self._engine]
        self._pool_view = [row_view(t) for t in self._pool]
        self._engine_rows = min((t.shape[0] for t in self._engine), default=0)
        self._pool_rows = min((t.shape[0] for t in self._pool), default=0)
        self._threads = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
        self._helpers = (
            ThreadPoolExecutor(self._threads - 1, thread_name_prefix="kv-offload-copy")
            if self._threads > 1 else None
        )
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

    def take_finished(self) -> list[TransferResult]:
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
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

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
        store = job.direction is Direction.STORE
        src_rows, dst_rows = (self._engine_rows, self._pool_rows) if store else (self._pool_rows, self._engine_rows)
        check_ids(job.src_ids, src_rows)
        check_ids(job.dst_ids, dst_rows)
        n = job.num_blocks
        nbytes = n * self._bytes_per_block
        ops = plan_copy(job.src_ids, job.dst_ids, pool_is_dst=store)
        if self._helpers is None or nbytes < PARALLEL_MIN_BYTES or not uses_numpy(ops):
            # Torch's gathers and slice copies are already parallel (OpenMP).
            self._apply(ops, store)
            return
        nchunks = min(self._threads * CHUNKS_PER_THREAD, max(1, nbytes // MIN_CHUNK_BYTES), n)
        chunks = iter(split_positions(n, nchunks))
        lock = threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    r = next(chunks, None)
                if r is None:
                    return
                lo, hi = r
                self._copy_range(job.src_ids[lo:hi], job.dst_ids[lo:hi], store)

        futures = [self._helpers.submit(drain) for _ in range(self._threads - 1)]
        err: BaseException | None = None
        try:
            drain()
        except BaseException as e:  # wait for the helpers before failing the job
            err = e
        for f in futures:
            try:
                f.result()
            except BaseException as e:
                err = err or e
        if err is not None:
            raise err

    def _copy_range(self, src_ids: np.ndarray, dst_ids: np.ndarray, store: bool) -> None:
        self._apply(plan_copy(src_ids, dst_ids, pool_is_dst=store), store)

    def _apply(self, ops: list[tuple], store: bool) -> None:
        if not ops:
            return
        if store:
            pairs = zip(self._engine, self._pool, self._engine_view, self._pool_view)
        else:
            pairs = zip(self._pool, self._engine, self._pool_view, self._engine_view)
        for src, dst, src_view, dst_view in pairs:
            copy_rows(src, dst, ops, src_view, dst_view)
