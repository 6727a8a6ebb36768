"""Shared test helpers: free loopback ports, deadline waits, a lossy ZeroMQ hop, a
uvicorn server thread. (Not named conftest: tests/connector has its own conftest, and
two top-level ``conftest`` modules would shadow each other on import.)"""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO

import zmq

# Ports below the ephemeral range: one chosen now and bound later must not be taken
# meanwhile as some connection's source port (see there).
from kvevents.demo.fleet import free_port  # noqa: F401  (re-exported for the tests)
from kvevents.wire.framing import unpack_seq


def rebind(make, timeout: float = 5.0):
    """``make()`` once the port the previous publisher held is free again (its socket
    closes on its own thread, just after ``shutdown`` returns)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return make()
        except zmq.ZMQError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def stop_process(proc: subprocess.Popen, log: IO | None = None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still running after ``timeout`` s; reaped either
    way, and ``log`` (its output file) closed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if log is not None:
        log.close()


def send_answer(handler: http.server.BaseHTTPRequestHandler, status: int, body: bytes,
                ctype: str = "text/plain") -> None:
    """One whole answer from a test server's request handler."""
    handler.send_response(status)
    handler.send_header("content-type", ctype)
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``pred`` until true or the deadline; returns the last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class LossyForwarder:
    """A real network hop that drops chosen live messages: SUB from ``upstream``,
    re-publish on a bound PUB at ``endpoint``, skipping seqs in ``drop``.

    Stands in for what loses frames in production (HWM overflow, a reconnect) while
    replay goes straight to the publisher's ROUTER.
    """

    def __init__(self, upstream: str, drop: Iterable[int] = ()) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.drop = set(drop)
        self.forwarded = 0
        self.dropped = 0
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._upstream = upstream
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self._upstream)
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{self.port}")
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(20):
                    continue
                frames = sub.recv_multipart()
                if unpack_seq(frames[1]) in self.drop:
                    self.dropped += 1
                    continue
                pub.send_multipart(frames)
                self.forwarded += 1
        finally:
            sub.close(0)
            pub.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


class ServerThread:
    """A real uvicorn server for an app, on a free 127.0.0.1 port, in a thread, configured
    as ``kvevents serve`` configures it."""

    def __init__(self, app) -> None:
        import uvicorn

        from kvevents.cli.serve import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        if not wait_until(lambda: self.server.started, 10):
            raise RuntimeError("uvicorn did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def require_binary(name: str) -> str:
    """Path of a system binary a test needs. Missing: skip locally, fail under CI."""
    import os
    import shutil

    import pytest

    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed (Debian package {name!r}; `make test` installs it as root)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


class PrometheusServer:
    """A real Prometheus (Debian package) scraping ``targets`` every second."""

    def __init__(self, tmp_path, targets: dict[str, list[str]], binary: str = "prometheus",
                 file_sd: str | None = None) -> None:
        import subprocess

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = "".join(
            f"  - job_name: {job}\n    scrape_interval: 1s\n    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in hosts)}]\n"
            for job, hosts in targets.items()
        )
        if file_sd is not None:  # targets from a file_sd JSON (e.g. the demo's)
            jobs += (f"  - job_name: file_sd\n    scrape_interval: 1s\n    file_sd_configs:\n"
                     f"      - files: [{file_sd!r}]\n        refresh_interval: 1s\n")
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n{jobs}")
        self._log = open(tmp_path / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """``promql``'s result now, or at Unix time ``at`` (a moment whose scrapes are
        known: later scrapes, failed or not, change nothing there)."""
        import httpx

        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=5)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"PromQL {promql!r} failed: {body}")
        return body["data"]["result"]

    def wait_ready(self, timeout: float = 30) -> None:
        import httpx

        def ready() -> bool:
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_until(ready, timeout, 0.2):
            raise RuntimeError("prometheus did not become ready")

    def close(self) -> None:
        stop_process(self.proc, self._log)


class HeldProxy:
    """A real TCP hop on 127.0.0.1 that holds what a client sends for ``hold_s`` after
    each connect (what comes back passes at once): a subscriber behind it is connected
    at once, but its ZeroMQ handshake and subscription reach the publisher late, as on
    a busy or distant network. ``cut()`` drops every open connection (the client then
    reconnects). Threads and sockets end on ``close()``."""

    def __init__(self, upstream_port: int, hold_s: float) -> None:
        import socket

        self.port, self.hold_s, self._upstream = free_port(), hold_s, upstream_port
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.1)
        self._conns: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self._upstream), timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            opened = time.monotonic()
            for src, dst, release_at in ((client, server, opened + self.hold_s), (server, client, opened)):
                threading.Thread(target=self._pipe, args=(src, dst, release_at), daemon=True).start()

    def _pipe(self, src, dst, release_at: float) -> None:
        src.settimeout(0.1)
        held: list[bytes] = []
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                data = None
            except OSError:
                break
            if data == b"":
                break
            if data:
                held.append(data)
            if held and time.monotonic() >= release_at:
                try:
                    dst.sendall(b"".join(held))
                except OSError:
                    break
                held.clear()
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            try:
                sock.shutdown(2)
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self._listener.close()


VLLM_HOW = "vLLM is not installed: run `make test CI=true` (installs the vllm extra) or pip install -e '.[vllm]'"


def require_vllm() -> None:
    """At a real-engine test module's top: skip it where vLLM is not installed, fail it
    under ``CI=true`` (CI installs the vllm extra: a missing vLLM is a broken install)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError("CI=true but vLLM is missing: " + VLLM_HOW)
        pytest.skip(VLLM_HOW, allow_module_level=True)


def wait_serving(gw: str, serve: subprocess.Popen, log, timeout: float = 60.0) -> None:
    """Until ``kvevents serve`` at ``gw`` answers ``/healthz`` with 200; fails with the
    log's tail (the file ``log``) if ``serve`` exits or ``timeout`` passes first."""
    import httpx

    def serving() -> bool:
        assert serve.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(gw + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    assert wait_until(serving, timeout=timeout, interval=0.2), log.read_text()[-3000:]


def wait_gateway_engines(gw: str, n: int, serve: subprocess.Popen, log, timeout: float = 60.0,
                         connected: bool = True) -> None:
    """Until ``kvevents serve`` at ``gw`` (process ``serve``, its output in the file
    ``log``) shows ``n`` engines, each reachable by its gateway and (``connected``) its
    event stream connected; fails with the log's tail if ``serve`` exits or ``timeout``
    passes first."""
    import httpx

    def up() -> bool:
        assert serve.poll() is None, log.read_text()[-3000:]
        try:
            engines = httpx.get(gw + "/v1/engines", timeout=5).json()["engines"]
        except httpx.HTTPError:
            return False
        return len(engines) == n and all((e["connected"] or not connected) and e["gateway"]["reachable"]
                                         for e in engines)

    assert wait_until(up, timeout=timeout, interval=0.2), log.read_text()[-3000:]

