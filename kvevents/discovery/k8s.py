"""Engines from Kubernetes pods: :class:`K8sSource` lists and watches the pods of one
namespace that match a label selector (the ``k8s`` extra: lightkube).

Lifecycle: construction loads the cluster config (an explicit kubeconfig, else the pod's
service account when running in a cluster, else ``KUBECONFIG`` / ``~/.kube/config``) and
checks the selector, so a bad setting fails at start-up (``ValueError``; ``ImportError``
naming the extra when lightkube is missing). :meth:`K8sSource.run` then loops: *list*
the pods (the set and its resourceVersion) and emit the set; *watch* from that version,
applying ADDED/MODIFIED/DELETED and emitting the whole set after each event. Watches end
server-side every ``watch_timeout_s`` and are resumed from the last version seen (events
and BOOKMARKs, which are asked for so a quiet namespace in a busy cluster keeps a fresh
version). Which pods count and what their annotations say: :mod:`.k8s_pods`.

Failure: ``410 Gone`` (the version fell out of the server's window, as an HTTP status or
an ERROR watch event) is routine: re-list at once, counted in ``status.extra["relists"]``.
Any other error (API server down, 5xx, a dropped stream) is ``status.failed``: the last
set stands (nothing is emitted), and after a back-off of 1 s doubling to 10 s, which
``stop`` interrupts, the loop re-lists. ``run`` returns within a fraction of a second of
``stop``, even from a blocked watch: a guard thread shuts the client's sockets down
(closing an httpx client does not wake a thread blocked reading), and is joined.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kvevents.discovery.k8s_pods import parse_selector, pod_ready, pod_specs
from kvevents.discovery.source import Emit, Source
from kvevents.discovery.targets import PortPlan
from kvevents.engines.spec import EngineSpec

__all__ = ["K8sSource", "SERVICE_ACCOUNT_DIR"]

log = logging.getLogger(__name__)

#: Where a pod finds its service account (token, CA, namespace).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MISSING_EXTRA = "Kubernetes discovery needs the k8s extra: pip install 'kvevents[k8s]'"
_BACKOFF_S = (1.0, 10.0)  # first and longest wait after a failed round
_NAMESPACE = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
# A watch reads with no timeout (it may be quiet for minutes); keepalive probes notice a
# peer that vanished without a FIN within about a minute, where the watch would hang.
_KEEPALIVE = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)] + [
    (socket.IPPROTO_TCP, getattr(socket, name), value)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if hasattr(socket, name)]


class _AbortableTransport:
    """An httpx2 transport (duck-typed around ``HTTPTransport``) whose connections can be
    shut down from another thread: :meth:`abort` wakes a read blocked on a watch."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._aborted = False

    def handle_request(self, request: Any) -> Any:
        # httpcore's trace extension hands us each new connection's socket (and its TLS
        # wrapper), the only public way to reach it.
        request.extensions = {**request.extensions, "trace": self._trace}
        if request.url.params.get("watch") == "true" and "allowWatchBookmarks" not in request.url.params:
            # lightkube's watch() has no parameter for it; the server then sends BOOKMARKs
            # (at least one before each timeout), which lightkube resumes from.
            request.url = request.url.copy_add_param("allowWatchBookmarks", "true")
        return self._inner.handle_request(request)

    def _trace(self, event: str, info: dict) -> None:
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            sock = info["return_value"].get_extra_info("socket")
            with self._lock:
                self._sockets.append(sock)
                aborted = self._aborted
            if aborted:  # connected just after abort(): do not let it block
                _shutdown(sock)

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _AbortableTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed


class K8sSource(Source):
    """The pods matching ``selector`` in ``namespace`` (see the module docstring)."""

    def __init__(self, selector: str, ports: PortPlan, *, namespace: str | None = None,
                 model: str | None = None, kubeconfig: str | None = None,
                 watch_timeout_s: int = 60) -> None:
        super().__init__()
        try:
            import httpx2
            import lightkube
            from lightkube.config.client_adapter import verify_cluster
            from lightkube.resources.core_v1 import Pod
        except ImportError as exc:
            raise ImportError(MISSING_EXTRA) from exc
        self._lk, self._httpx, self._verify, self._pod_type = lightkube, httpx2, verify_cluster, Pod
        if watch_timeout_s < 1:
            raise ValueError(f"watch_timeout_s must be at least 1, got {watch_timeout_s}")
        self.selector, self.ports, self.model = selector, ports, model
        self.watch_timeout_s = int(watch_timeout_s)
        self._labels = parse_selector(selector) or None
        self._config = _load_config(lightkube, kubeconfig)
        self.namespace = (namespace or self._config.namespace).strip()  # in a pod: its own
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ValueError(f"Kubernetes namespace {self.namespace!r} is not a valid name")
        self.origin = f"k8s:{self.namespace}/{selector}"
        self._pods: dict[str, Any] = {}  # name -> Pod, every pod the selector matches
        self._rv: str | None = None
        self._bad: dict[str, str] = {}  # pod name -> why skipped, to warn once per pod
        self._transport: _AbortableTransport | None = None  # the current round's, for the guard
        self._backoff = _BACKOFF_S[0]
        self._gone_at = float("-inf")
        self.status.extra.update(resource_version=None, relists=0, bad_pods=0)

    def describe(self) -> dict:
        return {"kind": "kubernetes", "namespace": self.namespace, "selector": self.selector,
                "resource_version": self._rv}

    def run(self, emit: Emit, stop: threading.Event) -> None:
        done = threading.Event()
        guard = threading.Thread(target=self._abort_on_stop, args=(stop, done),
                                 name=f"kvevents-k8s-stop:{self.namespace}", daemon=True)
        guard.start()
        try:
            while not stop.is_set():
                try:
                    self._round(emit, stop)
                except Exception as exc:
                    if stop.is_set():
                        break  # the guard's abort, or an error we no longer care about
                    if self._is_gone(exc):
                        self.status.extra["relists"] += 1
                        log.info("k8s %s: resourceVersion %s expired (410), re-listing", self.origin, self._rv)
                        # Two in a second means the server keeps refusing: do not spin.
                        if time.monotonic() - self._gone_at < 1.0:
                            stop.wait(self._backoff)
                        self._gone_at = time.monotonic()
                        continue
                    why = _describe(exc)
                    self.status.failed(why)
                    log.warning("k8s %s: %s; keeping the last %d engines, retrying in %.0f s",
                                self.origin, why, self.status.engines, self._backoff)
                    stop.wait(self._backoff)
                    self._backoff = min(self._backoff * 2, _BACKOFF_S[1])
        finally:
            done.set()
            guard.join()

    def _abort_on_stop(self, stop: threading.Event, done: threading.Event) -> None:
        # Repeated while run() winds down, so a round that started as stop was set (its
        # transport not yet visible here) is aborted too.
        while not done.is_set():
            if stop.wait(0.1):
                transport = self._transport
                if transport is not None:
                    transport.abort()
                done.wait(0.05)

    def _round(self, emit: Emit, stop: threading.Event) -> None:
        """List, emit, then watch until ``stop`` (returns) or an error (raises)."""
        config = self._config
        inner = self._httpx.HTTPTransport(verify=self._verify(config.cluster, config.user, config.abs_file),
                                          socket_options=_KEEPALIVE)
        self._transport = transport = _AbortableTransport(inner)
        # A client per round: closing it is what releases a watch stream that ended in an
        # exception (lightkube's sync watch leaves the response open).
        client = self._lk.Client(config, namespace=self.namespace, transport=transport,
                                 timeout=self._httpx.Timeout(10.0, connect=3.0))
        try:
            if stop.is_set():
                return
            listing = client.list(self._pod_type, namespace=self.namespace, labels=self._labels)
            self._pods = {pod.metadata.name: pod for pod in listing}
            self._set_rv(listing.resourceVersion)
            self._backoff = _BACKOFF_S[0]
            self._emit(emit)
            events = client.watch(self._pod_type, namespace=self.namespace, labels=self._labels,
                                  server_timeout=self.watch_timeout_s, resource_version=self._rv)
            for kind, pod in events:  # lightkube re-watches from the last version on timeout
                if pod.metadata is not None:
                    self._set_rv(pod.metadata.resourceVersion)
                if kind == "BOOKMARK":
                    continue  # only a newer version to resume from
                if kind == "DELETED":
                    self._pods.pop(pod.metadata.name, None)
                else:  # ADDED, MODIFIED
                    self._pods[pod.metadata.name] = pod
                self._emit(emit)
                if stop.is_set():
                    return
        finally:
            self._transport = None
            client.close()

    def _set_rv(self, rv: str | None) -> None:
        if rv:
            self._rv = self.status.extra["resource_version"] = rv

    def _emit(self, emit: Emit) -> None:
        specs: list[EngineSpec] = []
        names: set[str] = set()
        bad: dict[str, str] = {}
        for name in sorted(self._pods):
            pod = self._pods[name]
            if not pod_ready(pod):
                continue
            try:
                mine = pod_specs(pod, self.ports, self.model)
                taken = names.intersection(s.name for s in mine)
                if taken:  # e.g. pod `a-dp0` and pod `a` with two ranks
                    raise ValueError(f"engine name {sorted(taken)[0]!r} is already another pod's")
            except ValueError as exc:
                bad[name] = str(exc)
                if self._bad.get(name) != bad[name]:
                    log.warning("k8s %s: skipping pod %s: %s", self.origin, name, exc)
                continue
            specs.extend(mine)
            names.update(s.name for s in mine)
        self._bad = bad  # a pod fixed and broken again is warned about again
        self.status.extra["bad_pods"] = len(bad)
        emit(specs)
        self.status.succeeded(len(specs))

    def _is_gone(self, exc: Exception) -> bool:
        if isinstance(exc, self._lk.ApiError) and exc.status is not None and exc.status.code == 410:
            return True  # an ERROR watch event, or a JSON error response
        response = getattr(exc, "response", None)
        return isinstance(exc, self._httpx.HTTPStatusError) and response is not None \
            and response.status_code == 410


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status", None)  # lightkube's ApiError: the server's Status
    if status is not None and getattr(status, "code", None):
        return f"API server answered {status.code} {status.reason or ''}: {status.message or ''}".strip()
    response = getattr(exc, "response", None)
    if response is not None:
        return f"API server answered HTTP {response.status_code}"
    return f"{type(exc).__name__}: {exc}"


def _load_config(lightkube: Any, kubeconfig: str | None) -> Any:
    """The cluster to ask, as a lightkube ``SingleConfig``: ``kubeconfig`` if given, else
    the service account when in a pod, else ``KUBECONFIG`` (its first existing file) or
    ``~/.kube/config``. ``ValueError`` when none is usable."""
    try:
        if kubeconfig:
            return lightkube.KubeConfig.from_file(kubeconfig).get()
        account = Path(SERVICE_ACCOUNT_DIR)
        if os.environ.get("KUBERNETES_SERVICE_HOST") and (account / "token").is_file():
            # Its context's namespace is the pod's own (the account's namespace file).
            return lightkube.KubeConfig.from_service_account(account).get()
        paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
        path = next((p for p in paths if Path(p).expanduser().is_file()), paths[0] if paths else "~/.kube/config")
        return lightkube.KubeConfig.from_file(path).get()
    except Exception as exc:  # ConfigError, YAML, a missing key: all mean "no usable config"
        raise ValueError(f"Kubernetes discovery: no usable cluster config: {type(exc).__name__}: {exc}") from None
