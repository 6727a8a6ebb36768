"""``kvevents serve --workers N``: N processes serving one port, and the supervisor that
keeps them.

Each worker is a whole aggregator, exactly as a replica is: it follows every engine
itself (its own subscriptions, index, gateway and engine load polls), so workers agree
with the engines rather than with each other and nothing is shared on the request
path. Each binds its own listening socket to the port with ``SO_REUSEPORT``, and the
kernel spreads new connections over them by a hash of the connection's addresses.
What speaks for the whole process (``/readyz``, ``/metrics``, engines added at run
time) is in :mod:`kvevents.cli.worker_app`, over the shared
:class:`~kvevents.cli.worker_board.WorkerBoard`.

Per worker, from the settings: worker 0 snapshots to ``--data-dir`` itself, worker
``i`` to ``DATA_DIR/worker-i`` (each restores its own); ``--max-inflight`` and
``--max-connections`` bound the process, so each worker gets ``1/N`` of them (at
least 1): connections land on workers by the kernel's hash, so one worker may refuse
while another still has room, but the process never holds more than asked.
Engines that bind their endpoint (``bind=1``) can be bound by one process only and
are refused with ``--workers`` above 1.

Lifecycle: the supervisor checks the address is free, forks the workers (it has
started no thread, so forking is safe) and then only waits for signals. A worker that
dies is logged, counted (``kvevents_worker_restarts_total``) and started again, after a
backoff when it keeps dying young (0.5 s doubling to 10 s); a worker that exits with
status 2 before it was ever ready met a configuration error (a tokenizer that does not
load, a discovery setting): the supervisor stops the others and exits 2. SIGTERM or
SIGINT: every worker gets SIGTERM (uvicorn's graceful shutdown), those still there
after ``STOP_GRACE_S`` get SIGKILL, and the supervisor exits 0. Workers die with the
supervisor (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

from kvevents.cli.worker_board import WorkerBoard
from kvevents.service.settings import AggregatorSettings

log = logging.getLogger("kvevents.cli.workers")

#: Builds a worker's app and serves it (kvevents.cli.serve.serve_app).
ServeApp = Callable[..., int]

STOP_GRACE_S = 30.0
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.5, 10.0
_YOUNG_S = 10.0  # a worker that dies younger than this backs off before its next start
_SIGNALS = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT)
_CONFIG_ERROR = 2
#: Settings that bound the whole process: each worker gets its share.
_PROCESS_BOUNDS = ("max_inflight", "max_connections")


class WorkersError(ValueError):
    """Settings that cannot run as several workers (the message says which)."""


def worker_settings(settings: AggregatorSettings, index: int) -> AggregatorSettings:
    """The settings worker ``index`` of ``settings.workers`` runs with (module docstring)."""
    n = settings.workers
    update: dict = {"workers": 1}
    for bound in _PROCESS_BOUNDS:  # the process's bounds, split evenly
        if bound in type(settings).model_fields:
            update[bound] = max(1, getattr(settings, bound) // n)
    if settings.data_dir and index > 0:
        update["data_dir"] = os.path.join(settings.data_dir, f"worker-{index}")
    return settings.model_copy(update=update)


def check_settings(settings: AggregatorSettings) -> None:
    """Raises :class:`WorkersError` for settings only one process can run."""
    bound = [e.name for e in settings.engines if getattr(e, "bind", False)]
    if settings.workers > 1 and bound:
        raise WorkersError(f"--workers {settings.workers}: engine(s) {', '.join(bound)} bind "
                           "their endpoint (bind=1), which only one process can; let the "
                           "aggregator connect to them, or run one worker")


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when the supervisor goes (Linux); exit if it already has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def _worker_main(settings: AggregatorSettings, board: WorkerBoard, index: int,
                 serve: ServeApp) -> int:
    """Body of a forked worker: serve until SIGTERM; the exit status."""
    from kvevents.cli.worker_app import WorkerApp

    private = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        private.bind(board.private_socket(index))
        return serve(worker_settings(settings, index), reuse_port=True, extra_sockets=[private],
                     wrap=lambda app: WorkerApp(app, board, index))
    finally:
        private.close()


class Supervisor:
    """Starts, restarts and stops the workers; see the module docstring."""

    def __init__(self, settings: AggregatorSettings, serve: ServeApp) -> None:
        self.settings = settings
        self.serve = serve
        self.n = settings.workers
        self.board = WorkerBoard(self.n, f"{os.getpid()}-{secrets.token_hex(4)}")
        self.pids: dict[int, int] = {}  # pid -> worker index
        self.started_at = [0.0] * self.n
        self.failures = [0] * self.n  # young deaths in a row (the backoff's exponent)
        self.due: dict[int, float] = {}  # worker index -> when to start it again

    def _spawn(self, index: int, mask: set) -> None:
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            status = 1
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                _die_with_parent(parent)
                _tag_logs(index)
                status = _worker_main(self.settings, self.board, index, self.serve)
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        self.pids[pid] = index
        self.board.pid[index] = pid
        self.started_at[index] = time.monotonic()
        log.info("worker %d started (pid %d)", index, pid)

    def run(self) -> int:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for i in range(self.n):
                self._spawn(i, mask)
            return self._watch(mask)
        finally:
            self._stop_all()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _watch(self, mask: set) -> int:
        while True:
            wait = min((t - time.monotonic() for t in self.due.values()), default=5.0)
            info = signal.sigtimedwait(_SIGNALS, max(0.0, wait))
            if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
                log.info("stopping %d workers (%s)", len(self.pids),
                         signal.Signals(info.si_signo).name)
                return 0
            status = self._reap()
            if status is not None:
                return status
            now = time.monotonic()
            for index, when in list(self.due.items()):
                if when <= now:
                    del self.due[index]
                    self._spawn(index, mask)

    def _reap(self) -> int | None:
        """Handle every worker that exited; an exit status to end with, or None."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == 0:
                return None
            index = self.pids.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            self.board.ready[index] = 0.0
            self.board.pid[index] = 0
            if code == _CONFIG_ERROR and not self.board.ever_ready[index]:
                log.error("worker %d (pid %d) could not start (status 2); stopping", index, pid)
                return _CONFIG_ERROR
            lived = time.monotonic() - self.started_at[index]
            self.failures[index] = self.failures[index] + 1 if lived < _YOUNG_S else 0
            delay = 0.0 if not self.failures[index] else min(
                _BACKOFF_MAX_S, _BACKOFF_MIN_S * 2 ** (self.failures[index] - 1))
            self.board.restarts[index] += 1
            how = f"signal {-code}" if code < 0 else f"status {code}"
            log.warning("worker %d (pid %d) exited with %s after %.1fs; starting it again "
                        "in %.1fs (restart %d)", index, pid, how, lived, delay,
                        self.board.restarts[index])
            self.due[index] = time.monotonic() + delay

    def _stop_all(self) -> None:
        for pid in self.pids:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.pids and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                self.pids.pop(pid, None)
            else:
                time.sleep(0.05)
        for pid in self.pids:
            log.warning("worker pid %d still running %.0fs after SIGTERM: killed", pid, STOP_GRACE_S)
            _kill(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.pids.clear()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _tag_logs(index: int) -> None:
    """Prefix this worker's log lines with its index (the root handler's format)."""
    for handler in logging.getLogger().handlers:
        fmt = handler.formatter._fmt if handler.formatter else "%(message)s"  # type: ignore[union-attr]
        handler.setFormatter(logging.Formatter(f"[worker {index}] {fmt}"))


def run_workers(settings: AggregatorSettings, serve: ServeApp) -> int:
    """Serve with ``settings.workers`` processes until SIGTERM/SIGINT; the exit status.
    Each worker calls ``serve`` (:func:`kvevents.cli.serve.serve_app`: build the app,
    bind, run uvicorn). Raises :class:`WorkersError` before any worker starts."""
    check_settings(settings)
    import kvevents.api  # noqa: F401  (imported once here: workers fork with it loaded)

    log.info("serving %s:%d with %d workers", settings.host, settings.port, settings.workers)
    return Supervisor(settings, serve).run()
