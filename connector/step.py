"""What flows between the core's two roles in one engine step.

The engine describes its step to the scheduler side as a :class:`StepSchedule`; the
scheduler side answers with the :class:`StepTransfers` the worker side must run (loads
before the forward pass, stores after it); the worker side's :class:`WorkerReport`
flows back to the scheduler side. Adapters translate an engine's own step data into
these (:mod:`connector.vllm` wraps them in vLLM's pickled metadata classes, since vLLM
runs the two roles in two processes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from connector.transfer.abstract import TransferResult


class RequestView(Protocol):
    """What the core reads from an engine request (all read-only)."""

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
class StepSchedule:
    """The requests the engine computes in this step (what stores are planned from)."""

    requests: list[ScheduledRequest] = field(default_factory=list)


@dataclass(frozen=True)
class TransferSpec:
    """A copy the worker side must run: ``job_id`` names it in results.

    Ids are engine-block granular on both sides: engine KV block ids and CPU pool rows.
    """

    job_id: int
    req_id: str
    src_ids: np.ndarray
    dst_ids: np.ndarray


@dataclass
class StepTransfers:
    """The copies of one step: ``loads`` (CPU -> engine) start before the forward pass,
    ``stores`` (engine -> CPU) are submitted after it, once the step's KV is written.
    ``children``: per-child transfers of a MultiConnector, in child order.
    """

    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
    children: list[StepTransfers] | None = None


@dataclass
class WorkerReport:
    """What the worker side reports after a step.

    ``releasable``: finished requests the scheduler side held (delayed) whose stores have
    all landed: the engine may now free their blocks.
    ``loaded``: requests whose loads completed (successfully or not).
    ``load_failed``: the subset whose load failed: the engine must recompute those tokens.
    ``results``: every transfer job completed since the last report.
    ``children``: per-child reports of a MultiConnector, in child order.
    """

    releasable: set[str] = field(default_factory=set)
    loaded: set[str] = field(default_factory=set)
    load_failed: set[str] = field(default_factory=set)
    results: list[TransferResult] = field(default_factory=list)
    children: list[WorkerReport] | None = None
