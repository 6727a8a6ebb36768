"""Worker side of the offloading connector: owns the CPU pool and the transfer handler.

Lifecycle: ``register_kv_caches`` once (allocates the CPU pool, pinned with CUDA, and
starts the handler) -> per step ``start_load_kv(meta)`` before the forward pass,
``wait_for_save()`` after it (submits the stores: asynchronous, it never waits for them
despite vLLM's name) and ``get_finished(ids)`` -> :class:`KVConnectorOutput` ->
``shutdown()``.
"""

from __future__ import annotations

import torch

from connector.kv_layout import KVCacheLayout
from connector.metadata import ConnectorMetadata, KVConnectorOutput
from connector.transfer import TransferHandler, TransferJob, make_transfer_handler
from connector.transfer.abstract import Direction


class OffloadingConnectorWorker:
    def __init__(self, layout: KVCacheLayout, num_pool_rows: int) -> None:
        self.layout = layout
        self.num_pool_rows = num_pool_rows
        self.cpu_pool: dict[str, torch.Tensor] = {}
        self.engine_kv: dict[str, torch.Tensor] = {}  # the engine's tensors (not owned)
        self.handler: TransferHandler | None = None
        self._meta = ConnectorMetadata()
        self._job_req: dict[int, str] = {}
        self._stores_per_req: dict[str, int] = {}
        self._finished_waiting: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.handler is not None:
            raise RuntimeError("KV caches are already registered")
        self.engine_kv = dict(kv_caches)
        first = next(iter(kv_caches.values()))
        pin = first.is_cuda  # page-locked memory only pays off for device copies
        self.cpu_pool = {
            name: torch.zeros((self.num_pool_rows, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
            for name, t in kv_caches.items()
        }
        self.handler = make_transfer_handler(kv_caches, self.cpu_pool)

    def _submit(self, direction: Direction, specs: list) -> None:
        if not specs:
            return
        if self.handler is None:
            raise RuntimeError("register_kv_caches must be called first")
        for spec in specs:
            self._job_req[spec.job_id] = spec.req_id
            if direction is Direction.STORE:
                self._stores_per_req[spec.req_id] = self._stores_per_req.get(spec.req_id, 0) + 1
            self.handler.submit(TransferJob(spec.job_id, direction, spec.src_ids, spec.dst_ids))

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self._meta = metadata
        self._submit(Direction.LOAD, metadata.loads)

    def wait_for_save(self) -> None:
        self._submit(Direction.STORE, self._meta.stores)
        self._meta = ConnectorMetadata()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        if self.handler is not None:
            out.job_results = self.handler.get_finished()
        for res in out.job_results:
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
                out.finished_recving.add(req_id)
                if not res.success:
                    out.failed_recving.add(req_id)
        self._finished_waiting |= finished_req_ids
        done = {r for r in self._finished_waiting if r not in self._stores_per_req}
        self._finished_waiting -= done
        out.finished_sending = done
        return out

    def wait(self, timeout: float | None = None) -> bool:
        return self.handler.wait(timeout) if self.handler is not None else True

    def pending(self) -> int:
        return self.handler.pending() if self.handler is not None else 0

    def shutdown(self) -> None:
        if self.handler is not None:
            self.handler.shutdown()
