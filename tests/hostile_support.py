"""A real ``kvevents serve`` process in front of fake engines (:mod:`hostile_engine`),
with what the hostile-client tests and ``benchmarks/bench_hostile_clients.py`` read of
it: its open files, its RSS, its metrics and its log; and the rounds of requests whose
names a client chose (:func:`named_requests`). 127.0.0.1 only."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import pytest

from hostile_engine import EngineThread
from support import free_port
from text_tokenizer import build_bytelevel, require_transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def chat_body(stream: bool = True, n: int = 64, **extra) -> bytes:
    return json.dumps({"model": "fake", "stream": stream, "max_tokens": n, "messages": [
        {"role": "user", "content": "hello there"}], **extra}).encode()


def raw_request(port: int, body: bytes, path: str = "/v1/chat/completions",
                headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{headers}\r\n").encode() + body


def read_response(s: socket.socket, buf: bytes = b"", timeout: float = 10.0) -> tuple[bytes, bytes, bytes]:
    """One HTTP/1.1 response from ``s`` (head, decoded body, what followed it)."""
    s.settimeout(timeout)
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        assert got, f"connection closed before a response head: {buf!r}"
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += s.recv(65536)
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                got = s.recv(65536)
                assert got, "connection closed inside a chunk"
                rest += got
            if size == 0:
                return head, body, rest[2:]
            body, rest = body + rest[:size], rest[size + 2:]
    length = int(re.search(rb"content-length: *(\d+)", lower).group(1))
    while len(rest) < length:
        got = s.recv(65536)
        assert got
        rest += got
    return head, rest[:length], rest[length:]


def head_fields(head: bytes) -> tuple[int, dict[str, str]]:
    """A response head's status and headers (names lowercased)."""
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def reset(s: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a client that crashes does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


def named_requests(k: int) -> list[tuple[str, str, str, dict | None, dict]]:
    """The ``k``-th round of requests whose names a client chose: a model, an adapter, a
    salt, a session, a header, a path and an engine, each random; one request to each
    endpoint that takes such a name, in a fixed order: (endpoint, method, path, JSON body,
    headers). The served chat names the fake engines' model ``fake``."""
    r = uuid.uuid4().hex
    chat = {"model": f"m-{r}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "cache_salt": r, "lora_name": r}
    served = {"model": "fake", "messages": [{"role": "user", "content": f"hi {k}"}], "max_tokens": 2,
              "cache_salt": r}
    headers = {"x-session-id": r, f"x-{r[:12]}": r}
    return [
        ("chat", "POST", "/v1/chat/completions", chat, headers),
        ("chat stream", "POST", "/v1/chat/completions", {**chat, "stream": True}, headers),
        ("chat served", "POST", "/v1/chat/completions", served, headers),
        ("completions", "POST", "/v1/completions", {"model": f"fake:{r}", "prompt": "hi", "max_tokens": 2},
         headers),
        ("lookup", "POST", "/v1/lookup", {"token_ids": [1, 2, 3], "model": r, "lora_name": r}, headers),
        ("route", "POST", "/v1/route", {"token_ids": [1, 2, 3], "model": r}, headers),
        ("engine blocks", "GET", f"/v1/engines/{r}/blocks", None, headers),
        ("engine add", "POST", "/v1/engines", {"name": r, "endpoint": "tcp://127.0.0.1:1"}, headers),
        ("engine delete", "DELETE", f"/v1/engines/{r}", None, headers),
        ("unknown path", "GET", f"/v1/{r}", None, headers),
        ("models", "GET", "/v1/models", None, headers),
        ("discovery", "GET", f"/v1/discovery?source={r}", None, headers),
    ]


def series_count(text: str) -> int:
    """Samples on a Prometheus scrape (every line that is not a comment)."""
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


class GatewayProcess:
    """``kvevents serve`` following ``engines`` (their OpenAI URLs; no event streams),
    with ``args`` added (and ``env`` in its environment), run from the checkout at
    ``root``. Use as a context manager."""

    def __init__(self, engines: list[str], *args: str, log_level: str = "info",
                 root: str = ROOT, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="kvevents-hostile-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvevents.cli", "serve", "--host", "127.0.0.1", "--port",
               str(self.port), "--log-level", log_level]
        for i, url in enumerate(engines):
            cmd += ["--endpoint", f"e{i}=tcp://127.0.0.1:{free_port()},model=fake,http={url}"]
        cmd += list(args)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=root,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        self.n_engines = len(engines)

    def __enter__(self) -> "GatewayProcess":
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvevents serve exited: {self.log_text()[-3000:]}")
            try:
                engines = httpx.get(self.url + "/v1/engines", timeout=2).json()["engines"]
                if len(engines) == self.n_engines and all(e["gateway"]["reachable"] for e in engines):
                    return self
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError("the gateway never saw its engines reachable")

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def cpu_s(self) -> float:
        """utime + stime of the process (all its threads), from /proc."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()


def engines(n: int) -> EngineThread:
    """``n`` fake engines on one thread, counted together (``.urls``, ``.stats``)."""
    return EngineThread([free_port() for _ in range(n)])


def wait_for(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


# Fixtures of the hostile tests (imported by name into each test module).
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> pathlib.Path:
    """A small byte-level tokenizer made locally, for ``kvevents serve --tokenizer``."""
    require_transformers()
    return build_bytelevel(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def fleet():
    """Two fake engines (:mod:`hostile_engine`), closed after the test."""
    es = engines(2)
    yield es
    es.close()
