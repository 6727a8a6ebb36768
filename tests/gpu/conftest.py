"""The ``gpu`` fixture: where the GPU tests run, and the few device calls they make.

On a machine with CUDA the tests run on ``cuda:0`` with real streams and pinned pools.
In the GPU check's dry run (``KVEVENTS_GPU_CHECK=cpu``) they run on CPU tensors and
``make_transfer_handler`` builds the very same stream handler over host stand-ins
(``KVEVENTS_TRANSFER_STREAMS=host``); the checks that only mean something on a GPU
(timing overlap, device memory) skip there with a reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from connector.transfer.streams import HOST_STREAMS_ENV


@dataclass
class Gpu:
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def require_cuda(self, what: str) -> None:
        if not self.cuda:
            pytest.skip(f"{what}: only meaningful on a GPU (dry run)")


_cycles_per_ms: float | None = None


def spin(ms: float) -> None:
    """Queue a kernel on the current CUDA stream that keeps the GPU busy about ``ms``."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(10_000_000)
        torch.cuda.synchronize()
        _cycles_per_ms = 10_000_000 / ((time.perf_counter() - t0) * 1000)
    torch.cuda._sleep(int(ms * _cycles_per_ms))


@pytest.fixture
def gpu(monkeypatch) -> Gpu:
    if torch.cuda.is_available():
        monkeypatch.delenv(HOST_STREAMS_ENV, raising=False)
        return Gpu(torch.device("cuda", 0))
    monkeypatch.setenv(HOST_STREAMS_ENV, "host")
    return Gpu(torch.device("cpu"))
