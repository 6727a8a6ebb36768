"""Worker-side transfer handlers (tensors, threads, CUDA streams)."""

from __future__ import annotations

import torch

from connector.transfer.abstract import Direction, TransferHandler, TransferJob, TransferResult
from connector.transfer.cpu import CpuTransferHandler


def make_transfer_handler(engine_kv: dict[str, torch.Tensor], cpu_pool: dict[str, torch.Tensor]) -> TransferHandler:
    """The CUDA handler for CUDA caches, the threaded CPU handler otherwise."""
    if next(iter(engine_kv.values())).is_cuda:
        from connector.transfer.cuda import CudaTransferHandler

        return CudaTransferHandler(engine_kv, cpu_pool)
    return CpuTransferHandler(engine_kv, cpu_pool)


__all__ = [
    "CpuTransferHandler",
    "Direction",
    "TransferHandler",
    "TransferJob",
    "TransferResult",
    "make_transfer_handler",
]
