"""How many engines the aggregator can follow with the sockets and files it may open.

Every followed engine costs ZeroMQ sockets (the live SUB, the two PAIR ends of its socket
monitor, one replay DEALER) and file descriptors (one mailbox per socket plus one TCP
connection each for SUB and DEALER). Running out of either used to kill the subscriber
thread, so the budget is planned once at start: the soft open-file limit is raised
toward the hard one where the OS allows, the ZeroMQ context is sized for the engines, and
``max_engines`` is what both allow with a reserve left for HTTP clients and the process.

Failure: nothing here raises; a limit that cannot be raised is reported in the plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq

log = logging.getLogger(__name__)

SOCKETS_PER_ENGINE = 4  # SUB + monitor PAIR pair + replay DEALER
FDS_PER_ENGINE = 6  # 4 socket mailboxes + SUB and DEALER TCP connections
RESERVE_FDS = 256  # HTTP clients, log files, the interpreter's own
RESERVE_SOCKETS = 32
# Never plan for more than this many descriptors even if the hard limit is "unlimited".
_FD_CEILING = 1 << 20


@dataclass(frozen=True)
class Budget:
    """The plan: ``max_engines`` and what it was derived from."""

    max_engines: int
    max_sockets: int
    nofile_soft: int
    nofile_hard: int
    raised_from: int | None  # the soft limit before we raised it, if we did


def raise_nofile_limit() -> tuple[int, int, int | None]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (capped). Returns
    ``(soft, hard, previous_soft_or_None)``; on platforms without ``resource`` reports
    a conservative 1024."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 1024, 1024, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _FD_CEILING if hard == resource.RLIM_INFINITY else min(hard, _FD_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target, hard, soft
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY:
        soft = _FD_CEILING
    if hard == resource.RLIM_INFINITY:
        hard = _FD_CEILING
    return soft, hard, None


def plan_budget(max_engines: int | None = None) -> Budget:
    """Raise the file limit and work out how many engines fit. ``max_engines`` (a setting)
    caps the result further; it never raises it above what the files allow."""
    soft, hard, before = raise_nofile_limit()
    by_files = max(0, (soft - RESERVE_FDS) // FDS_PER_ENGINE)
    by_sockets = max(0, (_socket_limit() - RESERVE_SOCKETS) // SOCKETS_PER_ENGINE)
    fit = min(by_files, by_sockets)
    if max_engines is not None:
        fit = min(fit, max_engines)
    return Budget(
        max_engines=fit,
        max_sockets=fit * SOCKETS_PER_ENGINE + RESERVE_SOCKETS,
        nofile_soft=soft, nofile_hard=hard, raised_from=before,
    )


def _socket_limit() -> int:
    """libzmq's compiled-in ceiling for ZMQ_MAX_SOCKETS."""
    ctx = zmq.Context()
    try:
        return int(ctx.get(zmq.SOCKET_LIMIT))
    finally:
        ctx.term()


def make_context(budget: Budget) -> zmq.Context:
    """A ZeroMQ context sized for ``budget`` (MAX_SOCKETS must be set before the first
    socket is created)."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, max(budget.max_sockets, 64))
    return ctx
