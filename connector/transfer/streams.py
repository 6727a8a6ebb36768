"""Streams and events for :class:`connector.transfer.cuda.CudaTransferHandler`.

The handler orders its copies with streams (a store waits for the engine's compute so
far; later compute waits for a load) and learns of completion by polling events. It
takes those primitives from a :class:`StreamOps`:

- :class:`CudaStreams` is ``torch.cuda`` itself: real streams, timed CUDA events, and
  the CPU pool must be pinned host memory (pageable memory would make every
  device<->host copy synchronous).
- :class:`HostStreams` runs the very same handler code over CPU tensors: every stream
  call is a no-op and an event is complete once recorded (its elapsed time is wall
  time). It is the GPU check's dry run (``benchmarks/gpu/check.sh --cpu``), so the CUDA
  handler's indexing, run planning and ordering are exercised on machines without a GPU.
  It is not a production path: the threaded :class:`CpuTransferHandler` is faster on CPU.

``make_transfer_handler`` picks CUDA streams for CUDA caches; setting
``KVEVENTS_TRANSFER_STREAMS=host`` makes it use the stream handler with host streams
over CPU caches (the dry run).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Protocol

import torch

#: ``make_transfer_handler`` uses the stream handler on CPU caches when this env var is "host".
HOST_STREAMS_ENV = "KVEVENTS_TRANSFER_STREAMS"


class StreamOps(Protocol):
    """What the stream handler needs of a device's streams and events."""

    requires_pinned: bool

    def new_stream(self, device: torch.device) -> Any: ...

    def current_stream(self, device: torch.device) -> Any: ...

    def new_event(self) -> Any:
        """A timed event: ``record(stream)``, ``query()``, ``synchronize()``, ``elapsed_time(end)`` (ms)."""

    def use(self, stream: Any) -> ContextManager[Any]:
        """Make ``stream`` current for the kernels queued inside the block."""


class CudaStreams:
    """``torch.cuda``'s streams and timed events."""

    requires_pinned = True

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def use(self, stream: torch.cuda.Stream) -> ContextManager[Any]:
        return torch.cuda.stream(stream)


class _HostEvent:
    """Complete once recorded: host copies are synchronous."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1000.0


class _HostStream:
    """Every ordering call is a no-op: host work already runs in program order."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class HostStreams:
    """Stand-ins for CPU tensors (the dry run); see the module docstring."""

    requires_pinned = False

    def __init__(self) -> None:
        self._current = _HostStream()

    def new_stream(self, device: torch.device) -> _HostStream:
        return _HostStream()

    def current_stream(self, device: torch.device) -> _HostStream:
        return self._current

    def new_event(self) -> _HostEvent:
        return _HostEvent()

    def use(self, stream: Any) -> ContextManager[Any]:
        return contextlib.nullcontext(stream)
