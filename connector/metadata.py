"""The core's step plumbing between its scheduler role and its worker role.

The scheduler role builds a :class:`ConnectorMetadata` each step, the worker role
executes it, and the worker's :class:`KVConnectorOutput` flows back to the scheduler
role. Adapters translate an engine's own step data into these (:mod:`connector.vllm`
wraps them in vLLM's metadata classes, which vLLM pickles between processes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from connector.transfer.abstract import TransferResult


class RequestView(Protocol):
    """What the connector reads from an engine request (all read-only)."""

    request_id: str
    lora_name: str | None

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> Sequence[int]: ...

    @property
    def block_extra_keys(self) -> Any:
        """Extra keys of every block of this request (None or a tuple)."""


@dataclass
class ScheduledRequest:
    """One request in this step: its block table after allocation, tokens to compute."""

    request: RequestView
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)


@dataclass(frozen=True)
class TransferSpec:
    """A copy the worker must run: ``job_id`` names it in results."""

    job_id: int
    req_id: str
    src_ids: np.ndarray
    dst_ids: np.ndarray


@dataclass
class ConnectorMetadata:
    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """What the worker reports after a step.

    ``finished_sending``: finished requests whose delayed blocks may now be freed.
    ``finished_recving``: requests whose loads completed (successfully or not).
    ``failed_recving``: subset of those whose load failed: the engine must recompute.
    ``job_results``: every transfer job completed since the last report.
    ``children``: per-child outputs of a MultiConnector, in child order.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    job_results: list[TransferResult] = field(default_factory=list)
    children: list[KVConnectorOutput] | None = None
