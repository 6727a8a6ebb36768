"""Worker side of the offloading core: owns the CPU pool and the transfer handler.

Lifecycle: ``attach_kv_caches`` once (allocates the CPU pool, pinned with CUDA, and
starts the handler) -> per step ``start_loads(transfers)`` before the forward pass,
``submit_stores(transfers)`` after it (both asynchronous: they never wait for the
copies) and ``collect(newly_delayed)`` -> :class:`WorkerReport` -> ``shutdown()``
(waits for queued copies). A copy that fails is reported, never raised.
"""

from __future__ import annotations

import torch

from connector.kv_layout import KVCacheLayout
from connector.step import StepTransfers, TransferSpec, WorkerReport
from connector.transfer import TransferHandler, TransferJob, make_transfer_handler
from connector.transfer.abstract import Direction


class OffloadWorker:
    """Worker side of one CPU tier of ``num_pool_rows`` engine-block rows."""

    def __init__(self, layout: KVCacheLayout, num_pool_rows: int) -> None:
        self.layout = layout
        self.num_pool_rows = num_pool_rows
        self.cpu_pool: dict[str, torch.Tensor] = {}
        self.engine_kv: dict[str, torch.Tensor] = {}  # the engine's tensors (not owned)
        self.handler: TransferHandler | None = None
        self._job_req: dict[int, str] = {}
        self._stores_per_req: dict[str, int] = {}
        self._delayed: set[str] = set()  # finished requests waiting for their stores

    def attach_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.handler is not None:
            raise RuntimeError("KV caches are already attached")
        self.engine_kv = dict(kv_caches)
        first = next(iter(kv_caches.values()))
        pin = first.is_cuda  # page-locked memory only pays off for device copies
        self.cpu_pool = {
            name: torch.zeros((self.num_pool_rows, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            for name, t in kv_caches.items()
        }
        self.handler = make_transfer_handler(kv_caches, self.cpu_pool)

    def _submit(self, direction: Direction, specs: list[TransferSpec]) -> None:
        if not specs:
            return
        if self.handler is None:
            raise RuntimeError("attach_kv_caches must be called first")
        for spec in specs:
            self._job_req[spec.job_id] = spec.req_id
            if direction is Direction.STORE:
                self._stores_per_req[spec.req_id] = self._stores_per_req.get(spec.req_id, 0) + 1
            self.handler.submit(TransferJob(spec.job_id, direction, spec.src_ids, spec.dst_ids))

    def start_loads(self, transfers: StepTransfers) -> None:
        self._submit(Direction.LOAD, transfers.loads)

    def submit_stores(self, transfers: StepTransfers) -> None:
        self._submit(Direction.STORE, transfers.stores)

    def collect(self, newly_delayed: set[str]) -> WorkerReport:
        out = WorkerReport()
        if self.handler is not None:
            out.results = self.handler.take_finished()
        for res in out.results:
            req_id = self._job_req.pop(res.job_id, None)
            if req_id is None:
                continue
            if res.direction is Direction.STORE:
                left = self._stores_per_req.get(req_id, 1) - 1
                if left:
                    self._stores_per_req[req_id] = left
                else:
                    self._stores_per_req.pop(req_id, None)
            else:
                out.loaded.add(req_id)
                if not res.success:
                    out.load_failed.add(req_id)
        self._delayed |= newly_delayed
        done = {r for r in self._delayed if r not in self._stores_per_req}
        self._delayed -= done
        out.releasable = done
        return out

    def wait(self, timeout: float | None = None) -> bool:
        return self.handler.wait(timeout) if self.handler is not None else True

    def pending(self) -> int:
        return self.handler.pending() if self.handler is not None else 0

    def shutdown(self) -> None:
        if self.handler is not None:
            self.handler.shutdown()
