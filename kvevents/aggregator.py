"""The aggregator: follows publishers, keeps the prefix index, answers queries.

Ownership and threads:

* :class:`Aggregator` owns a :class:`~kvevents.subscriber.Subscriber` (one thread that
  owns every ZeroMQ socket), the :class:`~kvevents.index.PrefixIndex`, the pod registry
  and the :class:`~kvevents.feed.EventFeed`.
* Ingest runs on the subscriber thread, off the HTTP event loop: each batch is applied
  to the index in per-publisher seq order as the subscriber delivers it (the index takes
  its own lock, so lookups from HTTP threads see whole batches).
* The subscriber's signals are applied and counted: a restart drops the pod's state
  before its new batches; a loss that replay could not fill is counted and drops the
  pod's state too (the index only claims blocks it can vouch for), after which the
  pod's new announcements rebuild it.

Lifecycle: ``Aggregator(settings)`` -> ``start()`` -> queries / ``add_pod`` /
``remove_pod`` from any thread -> ``stop()``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvevents.feed import EventFeed
from kvevents.index import LookupResult, PrefixIndex
from kvevents.metrics import AggregatorMetrics
from kvevents.router import KVAwarePolicy
from kvevents.settings import AggregatorSettings, PodSpec
from kvevents.subscriber import (
    BatchesLost,
    BatchReceived,
    GapDetected,
    PublisherRestarted,
    Signal,
    SourceConfig,
    SourceStats,
    Subscriber,
)

log = logging.getLogger(__name__)


class PodExistsError(ValueError):
    pass


@dataclass
class PodState:
    spec: PodSpec
    added_at: float
    resyncs: int = 0  # times its state was dropped after a loss


class Aggregator:
    """See the module docstring."""

    def __init__(
        self, settings: AggregatorSettings, registry: CollectorRegistry | None = None
    ) -> None:
        self.settings = settings
        self.index = PrefixIndex()
        self.feed = EventFeed(settings.event_feed_size)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = AggregatorMetrics(self, self.registry)
        self.router = KVAwarePolicy()
        self._pods: dict[str, PodState] = {}
        self._pods_lock = threading.Lock()
        self._subscriber = Subscriber(self._on_signal, replay_timeout=settings.replay_timeout_s)
        self.started_at = time.time()
        for spec in settings.pods:
            self.add_pod(spec)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._subscriber.start()

    def stop(self) -> None:
        self._subscriber.stop()

    # -- pods ------------------------------------------------------------------------

    def add_pod(self, spec: PodSpec) -> None:
        """Follow a new publisher. Raises :class:`PodExistsError` for a taken name."""
        with self._pods_lock:
            if spec.name in self._pods:
                raise PodExistsError(f"pod {spec.name!r} already exists")
            self._pods[spec.name] = PodState(spec, time.time())
        self._subscriber.add_source(
            SourceConfig(
                spec.name, spec.endpoint, replay_endpoint=spec.replay_endpoint,
                topic=spec.topic, bind=spec.bind,
            )
        )
        self.feed.publish("pod_added", {"pod": spec.name, "endpoint": spec.endpoint})

    def remove_pod(self, name: str) -> None:
        """Unsubscribe and drop the pod's state. Raises ``KeyError`` if unknown."""
        with self._pods_lock:
            if name not in self._pods:
                raise KeyError(name)
            del self._pods[name]
        self._subscriber.remove_source(name)
        self.index.drop_pod(name)
        self.metrics.forget_pod(name)
        self.feed.publish("pod_removed", {"pod": name})

    def pod_specs(self) -> list[PodSpec]:
        with self._pods_lock:
            return [p.spec for p in self._pods.values()]

    def source_stats(self) -> dict[str, SourceStats]:
        return self._subscriber.stats()

    def pod_statuses(self) -> list[dict]:
        """One entry per pod, as ``GET /v1/pods`` shows it."""
        stats = self._subscriber.stats()
        now = time.time()
        out = []
        with self._pods_lock:
            pods = list(self._pods.values())
        for state in pods:
            spec = state.spec
            st = stats.get(spec.name) or SourceStats()
            out.append({
                "name": spec.name,
                "endpoint": spec.endpoint,
                "replay_endpoint": spec.replay_endpoint,
                "model": spec.model,
                "status": self._status(st, now),
                "connected": st.connected > 0,
                "last_seq": st.last_seq,
                "lag_seconds": None if st.last_batch_ts is None else max(0.0, now - st.last_batch_ts),
                "last_event_age_seconds": None if st.last_received is None else now - st.last_received,
                "blocks": self.index.pod_block_counts(spec.name),
                "batches": st.batches,
                "gaps": st.gaps,
                "replayed_batches": st.replayed_batches,
                "lost_batches": st.lost_batches,
                "restarts": st.restarts,
                "resyncs": state.resyncs,
                "malformed": st.malformed_frames + st.decode_errors,
            })
        return out

    def _status(self, st: SourceStats, now: float) -> str:
        """live: a message within ``stale_after_s``; stale: connected (or never heard
        from yet) but silent; down: no connection to the publisher."""
        if st.connected <= 0:
            return "down"
        if st.last_received is not None and now - st.last_received <= self.settings.stale_after_s:
            return "live"
        return "stale"

    # -- queries ---------------------------------------------------------------------

    def lookup(
        self, token_ids: list[int], model: str | None = None, lora_name: str | None = None,
        *, endpoint: str = "lookup",
    ) -> LookupResult:
        t0 = time.perf_counter()
        result = self.index.lookup(token_ids, model=model, lora_name=lora_name)
        self.metrics.observe_lookup(endpoint, time.perf_counter() - t0, result, model)
        return result

    # -- ingest (subscriber thread) -----------------------------------------------------

    def _model_of(self, pod: str) -> tuple[bool, str | None]:
        state = self._pods.get(pod)
        return (state is not None, state.spec.model if state else None)

    def _on_signal(self, sig: Signal) -> None:
        known, model = self._model_of(sig.source)
        if not known:
            return  # removed while its last messages were in flight
        if isinstance(sig, BatchReceived):
            applied = self.index.apply_batch(sig.source, sig.batch, model=model)
            self.metrics.observe_batch(sig.source, sig.batch.ts)
            self.feed.publish("batch", {
                "pod": sig.source, "seq": sig.seq, "replayed": sig.replayed,
                "stored": applied.stored_blocks, "removed": applied.removed_blocks,
                "cleared": applied.cleared,
            })
        elif isinstance(sig, PublisherRestarted):
            self.index.drop_pod(sig.source)
            self.feed.publish("restart", {"pod": sig.source, "last_seq": sig.last_seq})
        elif isinstance(sig, BatchesLost):
            self.index.drop_pod(sig.source)
            with self._pods_lock:
                state = self._pods.get(sig.source)
                if state is not None:
                    state.resyncs += 1
            log.warning("pod %s: %d batches lost from seq %d (%s); its state was dropped",
                        sig.source, sig.count, sig.first_seq, sig.reason)
            self.feed.publish("loss", {"pod": sig.source, "first_seq": sig.first_seq,
                                       "count": sig.count, "reason": sig.reason})
        elif isinstance(sig, GapDetected):
            self.feed.publish("gap", {"pod": sig.source, "expected": sig.expected_seq,
                                      "received": sig.received_seq})
