"""Worker-side transfer jobs: copy batches of blocks between the engine's KV cache and
the CPU pool.

Lifecycle: ``submit(job)`` returns at once (the copy runs asynchronously: on a worker
thread without CUDA, on a per-direction CUDA stream with one); ``take_finished()`` returns
the jobs that completed since the last call, **in submission order** per direction, each
with success, bytes moved and seconds taken. A job that raises is reported with
``success=False`` (its destination may hold partial data: the scheduler rolls a store
back and recomputes a load); it never kills the handler. ``shutdown()`` waits for queued
jobs and stops the worker.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


class Direction(enum.Enum):
    STORE = "store"  # engine (GPU) -> CPU pool
    LOAD = "load"  # CPU pool -> engine (GPU)


@dataclass(frozen=True)
class TransferJob:
    """Copy block ``src_ids[i]`` to block ``dst_ids[i]`` in every layer.

    For a store, src ids index the engine KV cache and dst ids the CPU pool; for a load
    the reverse. Ids are engine-block granular in both (a CPU slot of an offloaded block
    of k engine blocks spans k consecutive pool rows).
    """

    job_id: int
    direction: Direction
    src_ids: np.ndarray
    dst_ids: np.ndarray

    def __post_init__(self) -> None:
        if self.src_ids.shape != self.dst_ids.shape or self.src_ids.ndim != 1:
            raise ValueError("src_ids and dst_ids must be 1-D and of equal length")

    @property
    def num_blocks(self) -> int:
        return int(self.src_ids.shape[0])


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    direction: Direction
    success: bool
    num_bytes: int
    seconds: float


class TransferHandler(ABC):
    @abstractmethod
    def submit(self, job: TransferJob) -> None: ...

    @abstractmethod
    def take_finished(self) -> list[TransferResult]: ...

    @abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has finished (True) or ``timeout`` passed."""

    @abstractmethod
    def pending(self) -> int:
        """Jobs submitted and not yet returned by ``take_finished``."""

    @abstractmethod
    def shutdown(self) -> None: ...
