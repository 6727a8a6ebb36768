"""Worker-side transfer handlers (tensors, threads, CUDA streams)."""

from __future__ import annotations

import os

import torch

from connector.transfer.abstract import Direction, TransferHandler, TransferJob, TransferResult
from connector.transfer.cpu import CpuTransferHandler


def make_transfer_handler(engine_kv: dict[str, torch.Tensor], cpu_pool: dict[str, torch.Tensor]) -> TransferHandler:
    """The CUDA stream handler for CUDA caches, the threaded CPU handler otherwise.

    With ``KVEVENTS_TRANSFER_STREAMS=host`` CPU caches get the stream handler over host
    stand-ins (:class:`connector.transfer.streams.HostStreams`): the GPU check's dry run.
    """
    from connector.transfer.streams import HOST_STREAMS_ENV, HostStreams

    cuda = next(iter(engine_kv.values())).is_cuda
    if cuda or os.environ.get(HOST_STREAMS_ENV) == "host":
        from connector.transfer.cuda import CudaTransferHandler

        return CudaTransferHandler(engine_kv, cpu_pool, None if cuda else HostStreams())
    return CpuTransferHandler(engine_kv, cpu_pool)


__all__ = [
    "CpuTransferHandler",
    "Direction",
    "TransferHandler",
    "TransferJob",
    "TransferResult",
    "make_transfer_handler",
]
