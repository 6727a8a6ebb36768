"""What the workers of one ``kvevents serve --workers N`` know of each other, in memory
they share, and how a worker asks another one.

:class:`WorkerBoard` is an anonymous shared mapping (``mmap(-1)``, no file: the
Kubernetes manifests run with a read-only root filesystem) made by the supervisor
before it forks the workers, so every process sees the same slots. Each slot has one
writer: the worker writes its readiness stamp (the ``CLOCK_MONOTONIC`` time of its last
ready answer, the clock every process of the machine shares; 0 when not ready) and
whether it was ever ready; the supervisor writes the pid and the restart count, and
clears the stamp when the worker dies. Aligned 8-byte stores are not torn on the
platforms we run on, so no lock is needed.

:func:`peer_request` is one HTTP/1.1 request to another worker over its private socket
(a Linux abstract Unix socket named by :func:`private_socket_name`: no file either),
with a deadline; it returns None (never raises) when the worker does not answer, so a
dead or stuck worker costs a scrape its series, not the scrape.
"""

from __future__ import annotations

import asyncio
import mmap
import socket
import time

#: A worker's stamp older than this is not ready (it beats every BEAT_S).
BEAT_S = 0.5
FRESH_S = 5.0
#: Header that marks a request from another worker: answer for yourself only.
INTERNAL_HEADER = "x-kvevents-worker-local"


class WorkerBoard:
    """Per-worker slots shared across ``fork``; see the module docstring."""

    _FIELDS = ("ready", "ever_ready", "pid", "restarts")

    def __init__(self, workers: int, token: str) -> None:
        self.workers = workers
        self.token = token  # names the private sockets of this supervisor's workers
        self._mem = mmap.mmap(-1, 8 * workers * len(self._FIELDS))
        view = memoryview(self._mem)
        step = 8 * workers
        self.ready = view[0:step].cast("d")
        self.ever_ready = view[step:2 * step].cast("q")
        self.pid = view[2 * step:3 * step].cast("q")
        self.restarts = view[3 * step:4 * step].cast("q")

    def is_ready(self, worker: int, now: float | None = None) -> bool:
        stamp = self.ready[worker]
        return stamp > 0 and (now if now is not None else time.monotonic()) - stamp < FRESH_S

    def not_ready(self) -> list[int]:
        now = time.monotonic()
        return [i for i in range(self.workers) if not self.is_ready(i, now)]

    def private_socket(self, worker: int) -> str:
        return private_socket_name(self.token, worker)


def private_socket_name(token: str, worker: int) -> str:
    """The abstract Unix socket name of ``worker`` (leading NUL: not a file)."""
    return f"\0kvevents-{token}-worker-{worker}"


async def peer_request(name: str, method: str, path: str, *, body: bytes = b"",
                       headers: list[tuple[bytes, bytes]] = (), timeout: float = 2.0
                       ) -> tuple[int, dict[str, str], bytes] | None:
    """``(status, headers, body)`` of one request to the worker listening on ``name``,
    or None when it cannot be had within ``timeout`` (no worker there, a stuck one, a
    reply that is not HTTP). Only ``content-length`` or close-delimited answers (the
    app's plain responses) are read."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            # Connected here, not by open_unix_connection(path): uvloop refuses an
            # abstract name (leading NUL) as a path.
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, name)
            except BaseException:
                sock.close()
                raise
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            head = [f"{method} {path} HTTP/1.1", "host: worker", "connection: close",
                    f"{INTERNAL_HEADER}: 1", f"content-length: {len(body)}"]
            skip = {b"host", b"connection", b"content-length", b"transfer-encoding",
                    INTERNAL_HEADER.encode()}
            head += [f"{k.decode('latin-1')}: {v.decode('latin-1')}" for k, v in headers
                     if k.lower() not in skip]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            raw = await reader.read(-1)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    finally:
        if writer is not None:
            writer.close()
    top, sep, payload = raw.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        return None
    fields = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        fields[key.strip().lower()] = value.strip()
    if "content-length" in fields and fields["content-length"].isdigit():
        payload = payload[:int(fields["content-length"])]
    return int(parts[1]), fields, payload
