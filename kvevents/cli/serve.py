"""``kvevents serve``: run the aggregator's HTTP server (uvicorn) until stopped.

The listening socket is bound here, before uvicorn starts, so an address in use or not
available is one clear error (:class:`ListenError`) instead of a server log line and a
bare exit status.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn

from kvevents.api import create_app
from kvevents.api.conn_guard import ConnLimits
from kvevents.api.server_protocol import protocol_class
from kvevents.discovery import DiscoveryConfigError
from kvevents.service.settings import AggregatorSettings
from kvevents.text import TokenizerLoadError

log = logging.getLogger(__name__)


class ListenError(OSError):
    """The HTTP address could not be bound."""


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening-ready TCP socket on ``host:port``; raises :class:`ListenError`.
    ``reuse_port``: ``SO_REUSEPORT``, so the workers of one server each bind the port
    and the kernel spreads connections over them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"--host {host!r}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # quick restarts (TIME_WAIT)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ListenError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                          "pick a free port with --port or KVEVENTS_PORT") from None
    sock.set_inheritable(True)
    return sock


# The ingest thread is busy (GIL held) whenever events flow; Python then hands the GIL
# to a waiting HTTP thread only every switch interval (5 ms by default), and one request
# needs it several times. 0.25 ms keeps lookups at sub-millisecond latency under ingest
# for a few percent of ingest throughput.
GIL_SWITCH_INTERVAL_S = 0.00025


# The ingest loop allocates Python containers by the ten thousand a second (decoded
# events and their lists), and a drain keeps up to a thousand batches alive at once, so
# the default collector (a young-generation pass every 700 net allocations, a full pass
# over every object of the process every 100 of those) took a third of the loop's time.
# What exists once the app is built (modules, FastAPI, pydantic) lives as long as the
# process: it is frozen out of every pass, and young passes run 14x less often.
GC_THRESHOLDS = (10_000, 10, 10)


def tune_gc() -> None:
    """Freeze what the process holds now and raise the young-generation threshold
    (the server's own choice; an application that embeds the aggregator keeps its own
    settings)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def uvicorn_config(app, *, lookup_in_protocol: bool = True, openai_in_protocol: bool = True,
                   limits: ConnLimits | None = None, **options) -> uvicorn.Config:
    """uvicorn's configuration for the aggregator's ``app``, with its HTTP protocol
    (:mod:`kvevents.api.server_protocol`): common lookups answered in it, before the ASGI
    cycle, unless ``lookup_in_protocol`` is false; the gateway's OpenAI requests handed
    to it from the protocol unless ``openai_in_protocol`` is false; connections under ``limits``
    (:mod:`kvevents.api.conn_guard`: head and body timeouts, a connection cap; default:
    those of the app's settings, else the defaults). ``options`` go to ``uvicorn.Config``."""
    if limits is None:
        settings = getattr(getattr(app, "state", None), "settings", None)
        limits = ConnLimits.from_settings(settings) if settings is not None else ConnLimits()
    http = protocol_class(app, limits, lookup=lookup_in_protocol, openai=openai_in_protocol) or "auto"
    return uvicorn.Config(app, http=http, **options)


def quiet_client_logs() -> None:
    """httpx logs every request at INFO: the gateway's requests and its /metrics polls
    (every engine, every second) would flood the log. Its warnings still show."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # lightkube's (pod discovery)


def run_server(settings: AggregatorSettings) -> int:
    """Serve until SIGINT/SIGTERM; the app's lifespan starts and stops the aggregator.
    With ``settings.workers`` above 1, :mod:`kvevents.cli.workers` runs that many
    processes on the port, each serving with :func:`serve_app`."""
    # Each request's text is encoded on the thread that asks (the GIL released): the
    # tokenizers library's own thread pool would only add hand-offs between threads
    # for the one or few pieces a request brings, while other requests use the cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if settings.workers > 1:
        from kvevents.cli.workers import WorkersError, run_workers

        # The address must be free for anyone, a previous kvevents included: tried
        # without SO_REUSEPORT (which would share it with whoever holds it), let go.
        bind_socket(settings.host, settings.port).close()
        try:
            return run_workers(settings, serve_app)
        except WorkersError as exc:
            print(f"kvevents serve: error: {exc}", file=sys.stderr)
            return 2
    return serve_app(settings)


def serve_app(settings: AggregatorSettings, *, reuse_port: bool = False,
              extra_sockets: Sequence[socket.socket] = (),
              wrap: Callable[[Any], Any] | None = None) -> int:
    """Build the app and serve it on ``settings``' address (and ``extra_sockets``) until
    SIGINT/SIGTERM; 2 when the app cannot be built. A worker of ``--workers`` binds with
    ``reuse_port`` and serves ``wrap(app)``."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        app = create_app(settings)
    except (TokenizerLoadError, DiscoveryConfigError) as exc:  # one line, no traceback
        print(f"kvevents serve: error: {exc}", file=sys.stderr)
        return 2
    tune_gc()
    quiet_client_logs()
    sock = bind_socket(settings.host, settings.port, reuse_port=reuse_port)
    for engine in settings.engines:
        log.info("following %s at %s%s", engine.name, engine.endpoint,
                 f" (replay {engine.replay_endpoint})" if engine.replay_endpoint else "")
    config = uvicorn_config(wrap(app) if wrap else app, lookup_in_protocol=settings.lookup_in_protocol,
                            openai_in_protocol=settings.openai_in_protocol,
                            limits=ConnLimits.from_settings(settings),
                            log_level=settings.log_level, access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock, *extra_sockets])
    finally:
        sock.close()
    return 0
