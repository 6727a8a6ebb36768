"""The ASGI app of one worker of ``kvevents serve --workers N``: the aggregator's own
app, with the few answers that speak for the whole process.

Every request goes to the aggregator's app untouched (one path comparison here), but:

* ``GET /readyz`` is 200 only when this worker is ready *and* every other worker's
  readiness stamp on the :class:`~kvevents.cli.worker_board.WorkerBoard` is fresh; the
  body is this worker's own, plus ``worker``, ``pid`` and ``workers`` (how many, which
  are not ready). Each worker stamps the board every :data:`BEAT_S` from its own
  ``/readyz``, asked in process (connections land on workers by the kernel's hash, so
  no worker can count on being asked).
* ``GET /metrics`` is every worker's metrics in one exposition: this worker's and each
  other's (asked over its private socket), every series labelled ``worker="i"``, one
  HELP/TYPE per family, plus the supervisor's ``kvevents_worker_*`` series. Summing
  request counters over ``worker`` gives the process; gauges of the index or of the
  engines are per worker (each follows every engine: take ``max`` or ``avg``). A
  worker that does not answer in time is ``kvevents_worker_scraped{worker}`` 0.
* ``POST /v1/engines`` and ``DELETE /v1/engines/{name}`` that this worker accepts are
  repeated to every other worker (same headers, so the same ``--auth-token`` check),
  so all of them keep following the same engines. A worker started again after a
  death first takes the engines added or removed at run time from a peer (its
  ``GET /v1/engines``: origin ``api`` added, configured ones the peer no longer
  follows removed), and is not ready before that.

A request that carries :data:`INTERNAL_HEADER` (from another worker) is answered by this
worker alone, which is what stops a scrape from fanning out again.

Lifecycle: built by the worker before uvicorn starts; the readiness beat runs from the
app's startup (lifespan) to its shutdown, when the stamp is cleared.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from kvevents.cli.worker_board import BEAT_S, INTERNAL_HEADER, WorkerBoard, peer_request

log = logging.getLogger(__name__)

_INTERNAL = INTERNAL_HEADER.encode()
_FANOUT_BODY_LIMIT = 1 << 20  # an engine spec is a few hundred bytes
#: How long a restarted worker waits for a ready peer to copy run-time engine changes from.
SYNC_WAIT_S = 10.0


async def call_app(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]] = (),
                   body: bytes = b"") -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One request to an ASGI ``app`` in this process: ``(status, headers, body)``."""
    done = asyncio.Event()
    sent = False
    status, out_headers, chunks = 500, [], []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status, out_headers = message["status"], list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    path_only, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http", "path": path_only,
             "raw_path": path_only.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"host", b"worker"), (_INTERNAL, b"1"), *headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return status, out_headers, b"".join(chunks)


def merge_expositions(texts: dict[int, str]) -> str:
    """Prometheus text expositions of several workers as one: every sample labelled
    ``worker="i"``, each family's HELP and TYPE once, its samples together."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    loose: list[str] = []
    for worker, text in texts.items():
        samples = loose
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    head, samples = families.setdefault(parts[2], ([], []))
                    if not any(h.split(" ", 2)[1] == parts[1] for h in head):
                        head.append(line)
                continue
            samples.append(_with_worker(line, worker))
    out = []
    for head, samples in families.values():
        out.extend(head)
        out.extend(samples)
    out.extend(loose)
    return "\n".join(out) + "\n"


def _with_worker(line: str, worker: int) -> str:
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        sep = "" if line[brace + 1:brace + 2] == "}" else ","
        return f'{line[:brace + 1]}worker="{worker}"{sep}{line[brace + 1:]}'
    return f'{line[:space]}{{worker="{worker}"}}{line[space:]}'


class WorkerSeries:
    """The supervisor's series of every worker, from the board, as a Prometheus
    collector (``kvevents_workers``, ``kvevents_worker_ready``,
    ``kvevents_worker_restarts_total``, ``kvevents_worker_scraped``). ``scraped``: the
    workers whose own metrics are in this scrape (None: all of them)."""

    def __init__(self, board: WorkerBoard, scraped: set[int] | None = None) -> None:
        self.board = board
        self.scraped = scraped

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        board, now = self.board, time.monotonic()
        workers = range(board.workers)
        yield GaugeMetricFamily("kvevents_workers", "Worker processes serving the port "
                                "(kvevents serve --workers).", value=board.workers)
        ready = GaugeMetricFamily("kvevents_worker_ready", "1 when the worker's own /readyz "
                                  "said ready within the last few seconds.", labels=["worker"])
        restarts = CounterMetricFamily("kvevents_worker_restarts", "Times the worker's "
                                       "process died and was started again.", labels=["worker"])
        scraped = GaugeMetricFamily("kvevents_worker_scraped", "1 when the worker's own metrics "
                                    "are in this scrape (0: it did not answer in time).",
                                    labels=["worker"])
        for i in workers:
            ready.add_metric([str(i)], int(board.is_ready(i, now)))
            restarts.add_metric([str(i)], board.restarts[i])
            scraped.add_metric([str(i)], int(self.scraped is None or i in self.scraped))
        yield from (ready, restarts, scraped)


def _board_series(board: WorkerBoard, scraped: set[int]) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerSeries(board, scraped))
    return generate_latest(registry).decode()


class WorkerApp:
    """See the module docstring. ``app``: the aggregator's app; ``index``: this
    worker's slot on ``board``."""

    def __init__(self, app: Any, board: WorkerBoard, index: int, *,
                 scrape_timeout_s: float = 2.0) -> None:
        self.app = app
        self.board = board
        self.index = index
        self.scrape_timeout_s = scrape_timeout_s
        self._beat: asyncio.Task | None = None
        self._synced = board.restarts[index] == 0  # a first start has nothing to catch up
        self._sync_deadline: float | None = None

    @property
    def state(self) -> Any:
        """The aggregator app's state (the in-protocol lookup path reads it)."""
        return self.app.state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            path, method = scope["path"], scope["method"]
            if path in ("/readyz", "/metrics", "/v1/engines") or path.startswith("/v1/engines/"):
                if not any(k == _INTERNAL for k, _ in scope["headers"]):
                    if path == "/readyz" and method == "GET":
                        return await self._readyz(send)
                    if path == "/metrics" and method == "GET":
                        return await self._metrics(scope, send)
                    if (method == "POST" and path == "/v1/engines") or \
                            (method == "DELETE" and path.startswith("/v1/engines/")):
                        return await self._fan_out(scope, receive, send)
        elif kind == "lifespan":
            return await self.app(scope, self._lifespan_receive(receive),
                                  self._lifespan_send(send))
        await self.app(scope, receive, send)

    # -- readiness ---------------------------------------------------------------------

    def _lifespan_send(self, send: Any) -> Any:
        async def wrapped(message: dict) -> None:
            if message["type"] == "lifespan.startup.complete":
                self._beat = asyncio.get_running_loop().create_task(self._beat_loop())
            await send(message)
        return wrapped

    def _lifespan_receive(self, receive: Any) -> Any:
        async def wrapped() -> dict:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                self.board.ready[self.index] = 0.0  # leaving: not ready from now on
                if self._beat is not None:
                    self._beat.cancel()
            return message
        return wrapped

    async def _beat_loop(self) -> None:
        """Stamp the board from this worker's own /readyz every BEAT_S (after taking
        the run-time engine changes from a peer, when this is a restart)."""
        failed = False
        while True:
            try:
                if not self._synced:
                    self._synced = await self._sync_engines()
                status, _, _ = await call_app(self.app, "GET", "/readyz")
                ok = status == 200 and self._synced
                self.board.ready[self.index] = time.monotonic() if ok else 0.0
                if ok:
                    self.board.ever_ready[self.index] = 1
                failed = False
            except asyncio.CancelledError:
                raise
            except Exception:  # the beat must outlive one bad answer; said once
                self.board.ready[self.index] = 0.0
                if not failed:
                    log.exception("worker %d: readiness check failed", self.index)
                failed = True
            await asyncio.sleep(BEAT_S)

    async def _sync_engines(self) -> bool:
        """Make this worker follow what a ready peer follows (engines of origin ``api``
        and the configured ones); False while no peer answers."""
        peers = [i for i in range(self.board.workers)
                 if i != self.index and self.board.is_ready(i)]
        if self._sync_deadline is None:
            self._sync_deadline = time.monotonic() + SYNC_WAIT_S
        theirs = None
        for i in peers:
            got = await peer_request(self.board.private_socket(i), "GET", "/v1/engines")
            if got is not None and got[0] == 200:
                theirs = {e["name"]: e for e in json.loads(got[2])["engines"]
                          if e.get("origin") in ("static", "api")}
                break
        if theirs is None:
            if time.monotonic() < self._sync_deadline:
                return False
            # Every worker died at once (say): nobody to ask, the settings are all we have.
            log.warning("worker %d: no ready worker to take run-time engine changes from "
                        "within %.0fs; following the configured engines", self.index, SYNC_WAIT_S)
            return True
        status, _, body = await call_app(self.app, "GET", "/v1/engines")
        mine = {e["name"]: e for e in json.loads(body)["engines"]
                if e.get("origin") in ("static", "api")} if status == 200 else {}
        token = getattr(self.app.state.aggregator.settings, "auth_token", None)
        auth = [(b"authorization", f"Bearer {token}".encode())] if token else []
        for name in set(mine) - set(theirs):
            await call_app(self.app, "DELETE", f"/v1/engines/{name}", auth)
        for name in set(theirs) - set(mine):
            e = theirs[name]
            spec = {k: e.get(k) for k in ("name", "endpoint", "replay_endpoint", "model", "http")}
            status, _, out = await call_app(self.app, "POST", "/v1/engines",
                                            [*auth, (b"content-type", b"application/json")],
                                            json.dumps(spec).encode())
            if status >= 300:
                log.warning("worker %d: could not follow %s as worker %d does (%d: %s)",
                            self.index, name, peers[0], status, out[:200])
        log.info("worker %d: engines taken from a peer (%d added, %d removed)", self.index,
                 len(set(theirs) - set(mine)), len(set(mine) - set(theirs)))
        return True

    async def _readyz(self, send: Any) -> None:
        status, headers, body = await call_app(self.app, "GET", "/readyz")
        own_ready = status == 200 and self._synced
        # This worker's answer is now: stamp it, so a scrape right after a start agrees.
        self.board.ready[self.index] = time.monotonic() if own_ready else 0.0
        others = [i for i in self.board.not_ready() if i != self.index]
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        if not isinstance(doc, dict):
            doc = {}
        not_ready = sorted(others + ([] if own_ready else [self.index]))
        ready = own_ready and not others
        doc.update({"status": "ready" if ready else "not ready", "worker": self.index,
                    "pid": os.getpid(),
                    "workers": {"total": self.board.workers,
                                "ready": self.board.workers - len(not_ready),
                                "not_ready": not_ready}})
        await _respond(send, 200 if ready else 503, json.dumps(doc).encode(),
                       b"application/json")

    # -- metrics -----------------------------------------------------------------------

    async def _metrics(self, scope: dict, send: Any) -> None:
        peers = [i for i in range(self.board.workers) if i != self.index]
        own, *others = await asyncio.gather(
            call_app(self.app, "GET", "/metrics"),
            *(peer_request(self.board.private_socket(i), "GET", "/metrics",
                           timeout=self.scrape_timeout_s) for i in peers))
        status, headers, body = own
        if status != 200:  # this worker's own failure: pass it on as it is
            return await _respond(send, status, body, _content_type(headers))
        texts = {self.index: body.decode()}
        for i, got in zip(peers, others):
            if got is not None and got[0] == 200:
                texts[i] = got[2].decode()
        merged = merge_expositions(dict(sorted(texts.items()))) + _board_series(self.board, set(texts))
        await _respond(send, 200, merged.encode(), _content_type(headers))

    # -- engines followed at run time ------------------------------------------------

    async def _fan_out(self, scope: dict, receive: Any, send: Any) -> None:
        """Apply here; when accepted (2xx), repeat to every other worker."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > _FANOUT_BODY_LIMIT:
                return await _respond(send, 413, json.dumps(
                    {"detail": f"body larger than {_FANOUT_BODY_LIMIT} bytes"}).encode(),
                    b"application/json")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        path = scope["path"] + (f"?{scope['query_string'].decode()}" if scope["query_string"] else "")
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
        status, out_headers, out_body = await call_app(self.app, scope["method"], path,
                                                       headers, body)
        if 200 <= status < 300:
            peers = [i for i in range(self.board.workers) if i != self.index]
            answers = await asyncio.gather(*(peer_request(
                self.board.private_socket(i), scope["method"], path, body=body,
                headers=headers, timeout=5.0) for i in peers))
            for i, got in zip(peers, answers):
                if got is None or not 200 <= got[0] < 300:
                    log.warning("worker %d: %s %s not applied by worker %d (%s)", self.index,
                                scope["method"], scope["path"], i,
                                "no answer" if got is None else f"status {got[0]}")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k, v) for k, v in out_headers if k != b"content-length"]
                    + [(b"content-length", str(len(out_body)).encode())]})
        await send({"type": "http.response.body", "body": out_body})


def _content_type(headers: list[tuple[bytes, bytes]]) -> bytes:
    for k, v in headers:
        if k.lower() == b"content-type":
            return v
    return b"text/plain; charset=utf-8"


async def _respond(send: Any, status: int, body: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
