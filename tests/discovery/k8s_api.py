"""A fake Kubernetes API server for pods, on 127.0.0.1: list and watch as the real one
speaks them, for tests/discovery/test_k8s_source.py (no cluster runs here).

* ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...``: a ``PodList`` (``kind``,
  ``apiVersion``, ``metadata.resourceVersion``, ``items`` without kind/apiVersion).
* The same with ``watch=true|1&resourceVersion=N[&timeoutSeconds=S][&allowWatchBookmarks=true]``:
  HTTP 200 and newline-delimited watch events in chunked encoding. Events are those
  after N, typed against the selector as the server does (a pod that starts matching is
  ADDED to this watch, one that stops matching is DELETED). At ``timeoutSeconds`` the
  stream ends cleanly, with a BOOKMARK of the newest version first when asked for. A
  version older than the compacted window gets one ``ERROR`` event with a ``Status``
  of code 410, reason ``Expired`` (still HTTP 200), and the stream ends.
* Every request needs ``Authorization: Bearer <token>`` (else a 401 Status); all are
  recorded in :attr:`FakeKubeAPI.requests`. :attr:`FakeKubeAPI.fail_status` answers
  every request with that error Status instead; :meth:`FakeKubeAPI.stop` takes the
  server down (connections cut mid-stream), :meth:`FakeKubeAPI.start` brings it back on
  the same port.

Pods are built by :func:`make_pod` in the shape the API returns (recorded from a vLLM
Deployment's pod: full metadata, spec, status with conditions, podIP(s), container
statuses); only loopback addresses are used.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

_POD_PATH = re.compile(r"^/api/v1/namespaces/([a-z0-9-]+)/pods$")
_CREATED = "2026-03-02T09:14:05Z"


def status_object(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """The server's label selector semantics (=, ==, !=, in, notin, exists, !exists)."""
    parts = re.split(r",(?![^()]*\))", selector) if selector.strip() else []
    for part in (p.strip() for p in parts):
        if m := re.fullmatch(r"(\S+?)\s+(in|notin)\s*\((.*)\)", part):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",")}
            if (key in labels and labels[key] in values) != (op == "in"):  # notin: absent is fine
                return False
        elif m := re.fullmatch(r"(\S+?)\s*(!=|==|=)\s*(\S*)", part):
            key, op, value = m[1], m[2], m[3]
            if (labels.get(key) == value) != (op != "!="):
                return False
        elif part.startswith("!"):
            if part[1:].strip() in labels:
                return False
        elif part not in labels:
            return False
    return True


def make_pod(name: str, ip: str | None, *, namespace: str = "vllm", labels: dict | None = None,
             annotations: dict | None = None, phase: str = "Running", ready: bool = True,
             deleting: bool = False, node: str = "gpu-node-1") -> dict:
    """A pod as ``kubectl get pod -o json`` shows it (less kind/apiVersion, as in a list)."""
    labels = {"app": "vllm", "pod-template-hash": "7d9c8b5f4", **(labels or {})}
    started = phase == "Running"
    cond = lambda kind, ok: {"type": kind, "status": "True" if ok else "False",  # noqa: E731
                             "lastProbeTime": None, "lastTransitionTime": "2026-03-02T09:16:41Z"}
    meta: dict[str, Any] = {
        "name": name, "generateName": "vllm-7d9c8b5f4-", "namespace": namespace,
        "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{name}")), "resourceVersion": "0",
        "creationTimestamp": _CREATED, "labels": labels,
        "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-03-02T09:14:00Z", **(annotations or {})},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-7d9c8b5f4",
                             "uid": "5a3f4c0e-8d2b-4f7e-9a61-0c2d1e3f4a5b", "controller": True,
                             "blockOwnerDeletion": True}],
    }
    if deleting:
        meta.update(deletionTimestamp="2026-03-02T10:01:12Z", deletionGracePeriodSeconds=30)
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [cond("PodReadyToStartContainers", started), cond("Initialized", True),
                       cond("Ready", ready and started), cond("ContainersReady", ready and started),
                       cond("PodScheduled", True)],
        "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "startTime": "2026-03-02T09:14:05Z",
        "containerStatuses": [{
            "name": "vllm", "image": "docker.io/vllm/vllm-openai:v0.32.0",
            "imageID": "docker.io/vllm/vllm-openai@sha256:" + "3f" * 32,
            "containerID": "containerd://" + "9c" * 32 if started else None,
            "state": {"running": {"startedAt": "2026-03-02T09:15:02Z"}} if started
            else {"waiting": {"reason": "ContainerCreating"}},
            "lastState": {}, "ready": ready and started, "restartCount": 0, "started": started}],
        "qosClass": "Burstable",
    }
    if ip is not None:
        status.update(podIP=ip, podIPs=[{"ip": ip}])
    spec = {
        "containers": [{
            "name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
            "args": ["--model", "Qwen/Qwen3-0.6B", "--kv-events-config",
                     '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'],
            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
                      {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"}],
            "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "4", "nvidia.com/gpu": "1"}},
            "readinessProbe": {"httpGet": {"path": "/health", "port": 8000, "scheme": "HTTP"},
                               "periodSeconds": 5, "timeoutSeconds": 1, "successThreshold": 1,
                               "failureThreshold": 3},
            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
            "imagePullPolicy": "IfNotPresent"}],
        "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
        "serviceAccountName": "default", "serviceAccount": "default", "nodeName": node,
        "securityContext": {}, "schedulerName": "default-scheduler", "priority": 0,
        "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority",
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                         "effect": "NoExecute", "tolerationSeconds": 300}],
    }
    return {"metadata": meta, "spec": spec, "status": status}


def write_kubeconfig(path: Path, server: str, token: str, namespace: str | None = "vllm") -> Path:
    """A kubeconfig (JSON is YAML) with one context on ``server``, bearer ``token``."""
    context = {"cluster": "fake", "user": "discovery"} | ({"namespace": namespace} if namespace else {})
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "discovery", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": context}],
    }))
    return path


class FakeKubeAPI:
    """See the module docstring. Thread-safe; ``with FakeKubeAPI() as api:``."""

    def __init__(self, token: str = "s3cr3t-token") -> None:
        self.token = token
        self.port = 0
        self.fail_status: int | None = None
        self.send_bookmarks = True  # False: a server that sends none (they are best-effort)
        self.requests: list[dict] = []
        self._cond = threading.Condition()
        self._rv = 4200
        self._compacted = self._rv  # a watch from an older version gets 410
        self._expired = 0  # bumped by expire(): open watches end with 410
        self._pods: dict[tuple[str, str], dict] = {}
        self._history: list[tuple[int, dict | None, dict]] = []  # (rv, old, new or deleted)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ the objects
    def put(self, pod: dict, *, record: bool = True) -> dict:
        """Create or replace a pod (a new resourceVersion). ``record=False``: the change
        reaches no watch, as if its event had been compacted away before delivery."""
        with self._cond:
            pod = copy.deepcopy(pod)
            meta = pod["metadata"]
            key = (meta["namespace"], meta["name"])
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            old = self._pods.get(key)
            self._pods[key] = pod
            if record:
                self._history.append((self._rv, old, pod))
            self._cond.notify_all()
            return pod

    def delete(self, name: str, namespace: str = "vllm") -> None:
        with self._cond:
            old = self._pods.pop((namespace, name))
            self._rv += 1
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._history.append((self._rv, old, {**gone, "_deleted": True}))
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget the history: watches from any version before now get 410."""
        with self._cond:
            self._compacted = self._rv
            self._history.clear()

    def expire(self) -> None:
        """Compact, and end every open watch with an ERROR 410 event."""
        with self._cond:
            self.compact()
            self._expired += 1
            self._cond.notify_all()

    def watch_requests(self) -> list[dict]:
        return [r for r in self.requests if r["query"].get("watch") in ("true", "1")]

    # ------------------------------------------------------------------ the server
    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"api": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._closing = False
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-kube-api", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Down: stop listening and cut every open connection (watches mid-stream)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            conns = list(self._conns)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = None
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> FakeKubeAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    api: FakeKubeAPI

    def setup(self) -> None:
        super().setup()
        with self.api._cond:
            self.api._conns.add(self.connection)

    def finish(self) -> None:
        with self.api._cond:
            self.api._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, *args: Any) -> None:
        pass  # quiet

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        api = self.api
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        api.requests.append({"path": parts.path, "query": query, "authorization": self.headers.get("Authorization"),
                             "time": time.monotonic()})
        if self.headers.get("Authorization") != f"Bearer {api.token}":
            return self._json(401, status_object(401, "Unauthorized", "Unauthorized"))
        if api.fail_status is not None:
            return self._json(api.fail_status, status_object(api.fail_status, "InternalError",
                                                             "Internal error occurred: etcdserver: request timed out"))
        m = _POD_PATH.match(parts.path)
        if m is None:
            return self._json(404, status_object(404, "NotFound", "the server could not find the requested resource"))
        namespace, selector = m[1], query.get("labelSelector", "")
        if query.get("watch") in ("true", "1"):
            return self._watch(namespace, selector, query)
        with api._cond:
            items = [copy.deepcopy(p) for (ns, _), p in sorted(api._pods.items())
                     if ns == namespace and selector_matches(selector, p["metadata"]["labels"])]
            rv = api._rv
        self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)},
                         "items": items})

    def _chunk(self, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _watch(self, namespace: str, selector: str, query: dict) -> None:
        api = self.api
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()  # the real server answers a watch at once, events follow
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") == "true" and api.send_bookmarks
        with api._cond:
            given = query.get("resourceVersion") not in (None, "", "0")
            since = int(query["resourceVersion"]) if given else api._rv
            expired_at_start = api._expired
            too_old = since < api._compacted
            current = api._rv
            cursor = sum(1 for rv, _, _ in api._history if rv <= since)
            # No version: the current state first, as synthetic ADDED events.
            initial = [] if given else [p for (ns, _), p in sorted(api._pods.items()) if ns == namespace]
        for pod in initial:
            if event := self._typed(namespace, selector, None, pod):
                self._chunk(event)
        if too_old:
            self._chunk({"type": "ERROR", "object": status_object(
                410, "Expired", f"too old resource version: {since} ({current})")})
            return self._end()
        while True:
            with api._cond:
                while (cursor >= len(api._history) and not api._closing and api._expired == expired_at_start
                       and time.monotonic() < deadline):
                    api._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                events, cursor = api._history[cursor:], len(api._history)
                closing, expired = api._closing, api._expired != expired_at_start
                current = api._rv
            if closing:
                self.close_connection = True
                return  # cut mid-stream, no final chunk: the server went away
            for _, old, new in events:
                event = self._typed(namespace, selector, old, new)
                if event is not None:
                    self._chunk(event)
            if expired:
                self._chunk({"type": "ERROR", "object": status_object(
                    410, "Expired", f"too old resource version: {since} ({current})")})
                return self._end()
            if time.monotonic() >= deadline:
                if bookmarks:
                    self._chunk({"type": "BOOKMARK", "object": {
                        "kind": "Pod", "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(current),
                                     "annotations": {"k8s.io/initial-events-end": "true"}}}})
                return self._end()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    @staticmethod
    def _typed(namespace: str, selector: str, old: dict | None, new: dict) -> dict | None:
        """The event one watch sees for a change, as the server types it per selector."""
        if new["metadata"]["namespace"] != namespace:
            return None
        obj = {"kind": "Pod", "apiVersion": "v1", **{k: v for k, v in new.items() if k != "_deleted"}}
        was = old is not None and selector_matches(selector, old["metadata"]["labels"])
        now = selector_matches(selector, new["metadata"]["labels"])
        if new.get("_deleted"):
            kind = "DELETED" if was else None
        elif now:
            kind = "MODIFIED" if was else "ADDED"
        else:
            kind = "DELETED" if was else None
        return None if kind is None else {"type": kind, "object": obj}
